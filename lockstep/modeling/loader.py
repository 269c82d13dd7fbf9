"""Load a local HF causal-LM directory as the frozen base model shared by every tenant."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from lockstep.engine.types import ModelCard


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_base_model(
    directory: str | Path, served_name: str, device: torch.device | str | None = None
) -> tuple[PreTrainedModel, ModelCard]:
    """Load `directory` in fp32, eval mode, every base parameter frozen.

    Eager attention on purpose: CPU SDPA (flash) picks its kv block size from the sequence length,
    so a row's numbers would change with the padded length of the batch it is packed into; eager
    attention is a plain matmul + softmax whose extra (masked) columns contribute exact zeros.
    """
    directory = Path(directory).resolve()
    dev = torch.device(device) if device is not None else default_device()
    if dev.type == "cuda":
        # fp32 means fp32: TF32 would make numbers depend on the kernel the batch shape picks.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, attn_implementation="eager"
    )
    model.to(dev)  # type: ignore[arg-type]  # transformers wraps `to`; mypy misreads it
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    config = model.config
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding)
    card = ModelCard(
        name=served_name,
        directory=str(directory),
        arch=str(getattr(config, "model_type", "unknown")),
        vocab_size=int(embeddings.num_embeddings),
        max_context_length=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_id=None if eos is None else int(eos),
    )
    return model, card
