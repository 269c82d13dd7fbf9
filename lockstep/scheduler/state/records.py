"""Storage types: what the scheduler keeps in Redis.

Kept apart from the wire types (gateway) and the engine types (lockstep.engine.types): these
records change only when the storage layout changes, and they are versioned by their field names.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from lockstep.vocab import CheckpointType

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


class CustomLossRecord(msgspec.Struct, frozen=True):
    """A session's custom loss as created: the checked graph as plain data (never code)."""

    loss_id: str
    owner: str
    session_id: str
    seq_id: int
    name: str
    inputs: list[tuple[str, int]]
    graph_json: bytes  # the SDK's CustomLossGraph, as received
    digest: str  # of (name, inputs, graph): a retry under the same seq_id must match it
    created: float = 0.0


class SamplerRecord(msgspec.Struct):
    sampler_id: str
    owner: str
    session_id: str
    base_model: str
    model_path: str | None = None  # tinker:// path the sampler was created from
    adapter_dir: str | None = None  # resolved local PEFT directory; None = base model
    adapter_id: str | None = None  # engine-side name of that adapter version
    created: float = 0.0
    # Inflight clients (SDK kind="inflight") follow their training model's shared weights
    # target instead of fixed weights, at version `min_version` (their save's seq_id) or newer.
    inflight_model: str | None = None
    min_version: int = 0


class InflightTarget(msgspec.Struct, frozen=True):
    """A training model's shared, mutable inflight weights target: the newest inflight save.

    `version` is that save's seq_id, so versions of one model only move forward."""

    model_id: str
    version: int
    adapter_id: str  # engine-side name of this version's adapter
    adapter_dir: str
    published: float = 0.0


class CheckpointRecord(msgspec.Struct):
    checkpoint_id: str  # "<segment>/<name>", e.g. "weights/ckpt-1"
    checkpoint_type: CheckpointType
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
    kind: str
    tokens: int = 0  # tokens in the request (for the cycle's token budget)


class HistoryEntry(msgspec.Struct, frozen=True, array_like=True):
    """One committed forward, forward_backward or optim_step's metrics (`keys.history`):
    an array, as it is stored once per op for the run's whole life."""

    seq_id: int
    kind: str  # its queued kind (`ops.registry`; the built-in ones are `OpKind` members)
    time: float
    datums: int
    tokens: int
    metrics: dict[str, float]


encoder = msgspec.json.Encoder()


def decode(data: bytes | str, kind: type[T]) -> T:
    return msgspec.json.decode(data, type=kind)
