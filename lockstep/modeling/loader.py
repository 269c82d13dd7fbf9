"""Load a local HF causal-LM directory as the frozen base model shared by every tenant.

A vision-language model Lockstep serves images for (its card has a `VisionSpec`) loads as its
whole `ForConditionalGeneration` (vision tower and language model, the published layout); its
decoder and LM head are the language model's, so everything else sees a causal LM."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from lockstep.engine.types import Dtype, ModelCard


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`--dtype` to a torch dtype; None: fp32 on CPU, bf16 on CUDA."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return torch.bfloat16 if Dtype(name) is Dtype.BFLOAT16 else torch.float32


def load_base_model(
    directory: str | Path,
    served_name: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = "eager",
) -> tuple[PreTrainedModel, ModelCard]:
    """Load `directory` in `dtype`, eval mode, every base parameter frozen.

    Eager attention by default (the samplers): a plain matmul + softmax whose masked columns add
    exact zeros, whatever the padded length. None: the model's own default (the trainer, which
    switches the packed families to row-wise attention, `modeling.attention`, once it has looked
    at the model).
    """
    directory = Path(directory).resolve()
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        # fp32 means fp32: TF32 would make numbers depend on the kernel the batch shape picks.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    card = ModelCard.from_dir(directory, served_name)
    auto = AutoModelForCausalLM if card.vision is None else AutoModelForImageTextToText
    model: PreTrainedModel = auto.from_pretrained(
        str(directory), dtype=dtype, attn_implementation=attn_implementation
    )
    model.to(dev)  # type: ignore[arg-type]  # transformers wraps `to`; mypy misreads it
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    if embeddings.num_embeddings != card.vocab_size:  # the card is what requests are checked by
        raise ValueError(
            f"{directory}: the embedding table has {embeddings.num_embeddings} rows but "
            f"config.json says vocab_size {card.vocab_size}"
        )
    return model, card
