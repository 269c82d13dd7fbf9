"""Internal types exchanged between the scheduler and the engines.

These are deliberately separate from the wire types (what the SDK sends, in `lockstep.wire`) and
from the storage types (Redis records, in `lockstep.scheduler.state`): the scheduler
decodes a wire request into these, an engine never sees protobuf or JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Literal, TypeAlias

import numpy as np

from lockstep.engine.families import ModelConfig
from lockstep.engine.images import ImageInput, VisionSpec
from lockstep.engine.shape import TrainerPath

LossConfig = dict[str, float | str]
StopReason = Literal["stop", "length"]


class Dtype(StrEnum):
    """Base-weight dtypes a training engine runs in (`--dtype`); adapters and Adam stay fp32."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"


class Checkpointing(StrEnum):
    """When the local trainer recomputes decoder layers in backward (`--activation-checkpointing`)
    instead of keeping their activations."""

    AUTO = "auto"  # the fewest layers a micro-batch needs to fit the memory budget
    ALWAYS = "always"  # every layer of every micro-batch
    NEVER = "never"  # none: rows that would not fit without it are refused at submission


@dataclass(frozen=True)
class LoraSpec:
    """Shape of one tenant's adapter. `alpha` scales the update by alpha / rank."""

    rank: int = 32
    alpha: float = 32.0
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


@dataclass(frozen=True)
class ModelCard:
    """What the scheduler needs to know about the served base model."""

    name: str  # served name, e.g. "Lockstep/tiny-qwen3"
    directory: str  # local HF model directory (weights + tokenizer)
    arch: str  # e.g. "qwen3"
    vocab_size: int  # size of the embedding table: valid token ids are [0, vocab_size)
    max_context_length: int
    eos_token_id: int | None
    vision: VisionSpec | None = None  # None: image chunks are refused by name (text only)
    # How the training engine runs this model (set by the engine once it has described it):
    # GENERIC is the slow path, reported to clients and in a metric.
    trainer_path: TrainerPath = TrainerPath.PACKED

    @classmethod
    def from_dir(cls, model_dir: str | Path, served_name: str) -> ModelCard:
        """The card of a local Hugging Face model directory, from its `config.json` alone (no
        torch, no weights), the same for every engine. Multimodal configs keep the language
        model's settings in `text_config`; a vision-language family Lockstep serves images for
        also has its image processing (`VisionSpec`, from `preprocessor_config.json`)."""
        config = ModelConfig.read(model_dir)
        text = config.text
        eos = text.get("eos_token_id", config.settings.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return cls(
            name=served_name,
            directory=str(config.directory),
            arch=config.family.model_type,
            vocab_size=int(text["vocab_size"]),
            max_context_length=int(text.get("max_position_embeddings", 2048)),
            eos_token_id=None if eos is None else int(eos),
            vision=VisionSpec.of(config),
        )


@dataclass(frozen=True)
class MemoryBudget:
    """What one fused pass may hold, as the training engine reports it (`memory_budget`).

    The pass runs in micro-batches, so its memory is bounded by its longest row: the scheduler
    refuses, at submission, a datum of more than `max_row_tokens` model-input tokens.
    """

    budget_bytes: int  # memory a pass may use (0: not limited)
    max_row_tokens: int  # the longest datum a pass fits in it (0: no limit beyond the context)
    source: str  # how budget_bytes was found, for the operator (e.g. "cuda free after load")
    # The largest image (in patches) the vision tower's pass fits beside a micro-batch (0: no
    # limit, or a text-only model).
    max_image_patches: int = 0


NO_MEMORY_LIMIT = MemoryBudget(0, 0, "not limited")


@dataclass
class Datum:
    """One training example. Position i of `tokens` predicts `loss_inputs["target_tokens"][i]`."""

    tokens: np.ndarray  # int64 [T]
    loss_inputs: dict[str, np.ndarray]  # float32/int64, each [T] or [T, K]
    # Images at their placeholder positions of `tokens` (vision-language models), in order.
    images: tuple[ImageInput, ...] = ()


@dataclass(frozen=True)
class CustomLossInput:
    """One input of a custom loss: `logprobs` (first) or a loss_fn_inputs key, with its rank
    (0: scalar, 1: [T], 2: [T, K])."""

    name: str
    rank: int


# A custom loss graph's argument values as the SDK encodes them (JSON): plain values, lists, and
# one-key objects naming what they encode (`lockstep.custom_loss.graph.Encoding`).
Encoded: TypeAlias = "None | bool | int | float | str | list[Encoded] | dict[str, Encoded]"


@dataclass(frozen=True)
class CustomLossNode:
    """One node of a custom loss graph as plain data (the SDK's fx encoding: `{"ref": name}`
    for another node, `{"tuple": [...]}`, `{"slice": [...]}`, ...). Never executed as given:
    an engine rebuilds it from its own table of allowed operations."""

    op: str
    name: str
    target: str
    args: tuple[Encoded, ...] = ()
    kwargs: dict[str, Encoded] = field(default_factory=dict)


@dataclass(frozen=True)
class CustomLoss:
    """A stored custom loss, checked at creation (`lockstep.custom_loss`)."""

    loss_id: str
    name: str
    inputs: tuple[CustomLossInput, ...]
    nodes: tuple[CustomLossNode, ...]


class PassPart(StrEnum):
    """Which part of its request a `PassRequest` is. The scheduler splits a request larger than
    a tenant's share of a shared cycle into parts of whole datums run in consecutive cycles of
    that model (`TrainingEngine.run_passes` says what an engine keeps between them)."""

    WHOLE = "whole"  # the whole request
    FIRST = "first"  # the first part: the engine keeps the model's gradients as they were
    MIDDLE = "middle"
    LAST = "last"  # the last part: the engine forgets the gradients kept at the first part


@dataclass
class PassRequest:
    """One forward or forward_backward request of one model (one SDK chunk), or one part of it
    (`part`: its `data` are then that part's datums)."""

    request_id: str
    model_id: str
    loss_fn: str
    loss_config: LossConfig
    forward_only: bool
    data: list[Datum]
    custom_loss: CustomLoss | None = None  # loss_fn "custom": the stored loss it names
    part: PassPart = PassPart.WHOLE


@dataclass
class PassResult:
    request_id: str
    outputs: list[dict[str, np.ndarray]]  # per datum: "logprobs" (shape of target_tokens), ...
    metrics: dict[str, float]  # keys "name:reduction"; always "loss:sum"
    # This request failed alone (its own data: a NaN loss, an op error in its custom loss, a
    # row that runs out of memory even alone), a user error; nothing of it was applied.
    error: str | None = None

    @classmethod
    def failed(cls, request_id: str, error: str) -> PassResult:
        return cls(request_id, [], {}, error)


@dataclass(frozen=True)
class AdamConfig:
    """torch.optim.AdamW semantics; grad_clip_norm <= 0 disables clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


@dataclass
class OptimRequest:
    model_id: str
    adam: AdamConfig


@dataclass(frozen=True)
class SampleParams:
    max_tokens: int = 16
    seed: int | None = None
    temperature: float = 1.0
    top_k: int = -1  # -1: no limit
    top_p: float = 1.0
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[int, ...] = ()
    stop_at_eos: bool = True  # False when the SDK sent stop=[] (never stop early)


@dataclass
class SampleRequest:
    request_id: str
    adapter_id: str | None  # None: the base model
    prompt: list[int]
    num_samples: int
    params: SampleParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    # KV-cache namespace (the sampling session): engines may reuse cached prompt prefixes only
    # within one namespace. None: no reuse.
    cache_namespace: str | None = None
    # Images at their placeholder positions of `prompt` (vision-language models), in order.
    images: tuple[ImageInput, ...] = ()

    @property
    def prompt_logprob_start(self) -> int:
        """The first prompt position whose logprob is reported (position 0 never is)."""
        last_n = self.prompt_logprobs_last_n
        return 1 if last_n is None else max(1, len(self.prompt) - last_n)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    topk_ids: list[list[int]] | None = None  # [n, k] when topk_sample_logprobs > 0
    topk_logprobs: list[list[float]] | None = None


@dataclass
class SampleResult:
    request_id: str
    sequences: list[SampledSequence]
    # One entry per prompt token; NaN where not computed (always position 0).
    prompt_logprobs: list[float] | None = None
    # [prompt_len, k]; rows not computed are None.
    topk_prompt: list[list[tuple[int, float]] | None] | None = None
    error: str | None = field(default=None)  # a per-request user error (bad adapter, ...)
