"""The service's closed vocabularies, in one place: every layer (gateway, scheduler, engines,
storage) compares against these members instead of spelling the strings again.

They are `StrEnum`s so a member is its wire / Redis string: records written before these enums
existed decode unchanged, and JSON, protobuf string fields and Prometheus labels take them as is.
"""

from __future__ import annotations

from enum import StrEnum

from lockstep.errors import UserInputError


class OpKind(StrEnum):
    """What a queued job does: the built-in ops' kinds. Training kinds queue per model in seq_id
    order; samples do not. An op may bring a kind of its own (its module names it, the op
    registry `scheduler/ops/registry.py` knows every op's), so a queued job's kind is a `str`
    these members compare equal to."""

    CREATE_MODEL = "create_model"
    LOAD = "load"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE = "save"
    SAMPLE = "sample"
    # Answered at submission, never queued (older SDKs poll its future): frees a run's state.
    UNLOAD_MODEL = "unload_model"
    # Answered at submission too: stores a session's custom loss (its future gives the loss id).
    CREATE_CUSTOM_LOSS = "create_custom_loss"
    # Refused at submission (bad input): it failed with a 400 but still holds its seq_id, so the
    # model's later requests are not stuck behind a hole. It never reaches an engine.
    REJECTED = "rejected"


class InputKind(StrEnum):
    """Kinds of model input chunk an engine takes (its capabilities)."""

    TEXT = "text"
    IMAGE = "image"


class Optimizer(StrEnum):
    """Optimizer families a training run may name (the SDK's optimizer_config / params `type`).
    The contract carries AdamW steps only (its `AdamParams`)."""

    ADAMW = "adamw"

    @classmethod
    def named(cls, field: str, name: str) -> Optimizer:
        """The family `name` spells ("adam" is AdamW too); any other is a 400 naming `field`."""
        spelled = name.lower()
        if spelled in ("adamw", "adam"):
            return cls.ADAMW
        raise UserInputError(field, f"optimizer {name!r} is not supported; this server has adamw")


class JobStatus(StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class RunStatus(StrEnum):
    """What a training run is doing, as listed (GetTrainingRun, the console)."""

    TRAINING = "training"  # training requests queued
    IDLE = "idle"  # its session is live, nothing queued
    ENDED = "ended"  # its session ended (closed, or silent past the expiry)


class ErrorCategory(StrEnum):
    """The SDK's RequestErrorCategory: "user" errors are final, the SDK may retry others."""

    USER = "user"
    SERVER = "server"
    UNKNOWN = "unknown"


class QueueState(StrEnum):
    """Why a future is still pending (the SDK's TryAgain queue_state)."""

    ACTIVE = "active"
    PAUSED_CAPACITY = "paused_capacity"
    PAUSED_RATE_LIMIT = "paused_rate_limit"


class CheckpointType(StrEnum):
    TRAINING = "training"
    SAMPLER = "sampler"
    EXTERNAL = "external"


class ClockPolicy(StrEnum):
    """How cycles start (`--clock-policy`): when work arrives, or every period."""

    TRIGGERED = "triggered"
    PERIODIC = "periodic"


class EngineKind(StrEnum):
    """Training backends (`lockstep serve --engine`)."""

    LOCAL = "local"
    MEGATRON = "megatron"


class SamplerKind(StrEnum):
    """Sampling backends (`lockstep serve --sampler`)."""

    LOCAL = "local"
    VLLM = "vllm"
    SGLANG = "sglang"


class AuditEvent(StrEnum):
    """`<resource>_<action>`, the SDK's AuditLogEntry.event convention."""

    SESSION_CREATED = "session_created"
    SESSION_FINISHED = "session_finished"
    SESSION_EXPIRED = "session_expired"
    TRAINING_RUN_CREATED = "training_run_created"
    MODEL_UNLOADED = "model_unloaded"
    CHECKPOINT_CREATED = "checkpoint_created"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    CHECKPOINT_READ = "checkpoint_read"
    CHECKPOINT_DELETED = "checkpoint_deleted"
    CHECKPOINT_PUBLISHED = "checkpoint_published"
    CHECKPOINT_UNPUBLISHED = "checkpoint_unpublished"
    CHECKPOINT_COPIED = "checkpoint_copied"
    CUSTOM_LOSS_CREATED = "custom_loss_created"
