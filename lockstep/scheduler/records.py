"""Storage types: what the scheduler keeps in Redis.

Kept apart from the wire types (gateway) and the engine types (lockstep.engine.types): these
records change only when the storage layout changes, and they are versioned by their field names.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

T = TypeVar("T")


class LoraRecord(msgspec.Struct, frozen=True):
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class SessionRecord(msgspec.Struct):
    session_id: str
    owner: str
    created: float
    last_heartbeat: float
    user_metadata: dict[str, str] = {}
    tags: list[str] = []
    display_name: str | None = None
    project_id: str | None = None
    finished: bool = False


class ModelRecord(msgspec.Struct):
    """One training run (one LoRA tenant)."""

    model_id: str
    owner: str
    session_id: str
    base_model: str  # the name the client asked for (a served name or alias)
    lora: LoraRecord
    created: float
    last_request_time: float
    user_metadata: dict[str, str] = {}
    last_checkpoint: str | None = None  # checkpoint_id
    last_sampler_checkpoint: str | None = None


class SamplerRecord(msgspec.Struct):
    sampler_id: str
    owner: str
    session_id: str
    base_model: str
    model_path: str | None = None  # tinker:// path the sampler was created from
    adapter_dir: str | None = None  # resolved local PEFT directory; None = base model
    adapter_id: str | None = None  # engine-side name of that adapter version
    created: float = 0.0


class CheckpointRecord(msgspec.Struct):
    checkpoint_id: str  # "<segment>/<name>", e.g. "weights/ckpt-1"
    checkpoint_type: str  # "training" | "sampler" | "external"
    tinker_path: str
    directory: str
    time: float
    size_bytes: int = 0
    public: bool = False
    expires_at: float | None = None
    user_metadata: dict[str, str] = {}


class QueuedOp(msgspec.Struct, frozen=True):
    """What the planner sees of one queued training request (no payload)."""

    request_id: str
    model_id: str
    seq_id: int
    kind: str  # one of JOB_KINDS
    tokens: int = 0  # tokens in the request (for the cycle's token budget)


# Job kinds of training requests (a model's queue) and of samples (the sampling lane).
JOB_KINDS = ("create_model", "load", "forward", "forward_backward", "optim_step", "save", "sample")

encoder = msgspec.json.Encoder()


def decode(data: bytes | str, kind: type[T]) -> T:
    return msgspec.json.decode(data, type=kind)
