"""What one executed op produced: the unit `Cycles.commit` records in ONE Redis transaction.

Dispatch builds these (no Redis writes there); the clock commits them in seq_id order.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from lockstep.engine.interface import EngineDied
from lockstep.errors import UserInputError
from lockstep.scheduler.state import storage
from lockstep.scheduler.state.records import CheckpointRecord, InflightTarget, SamplerRecord
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory, JobStatus


@dataclass
class Outcome:
    result: pb.JobResult | None = None
    error: str | None = None
    category: ErrorCategory = ErrorCategory.USER
    checkpoint: CheckpointRecord | None = None  # a named checkpoint to register
    sampler: SamplerRecord | None = None  # an ephemeral sampler to register
    adapter_dir: Path | None = None  # new sampler weights to publish
    snapshot_seq: int | None = None  # the model's state after this op is its new snapshot
    inflight: InflightTarget | None = None  # the model's new inflight weights target
    # Its payload joins the model's replay log if it succeeded: a restore re-runs it until a
    # snapshot covers it (its op says so: scheduler/ops/).
    replayed: bool = False
    # What the run's metrics history records of it (`keys.history`; forward, forward_backward
    # and optim_step say so in their op), with the datums its metrics reduce over.
    metrics: dict[str, float] | None = None
    datums: int = 0

    @cached_property
    def result_bytes(self) -> bytes | None:
        """The result as stored and answered (serialized once)."""
        return None if self.result is None else bytes(self.result.SerializeToString())

    def recorded(self) -> Recorded:
        """What committing this outcome leaves in its job."""
        failed = self.error is not None
        return Recorded(
            JobStatus.FAILED if failed else JobStatus.DONE,
            self.result_bytes,
            self.error,
            self.category if failed else None,
        )


@dataclass(frozen=True)
class Recorded:
    """A job's outcome fields once committed: what a waiting future answers."""

    status: JobStatus
    result: bytes | None
    error: str | None
    category: ErrorCategory | None


NO_OUTCOME = Outcome(
    error="internal error: the request produced no outcome", category=ErrorCategory.SERVER
)


def failure(exc: BaseException, what: str = "the request") -> Outcome:
    """The outcome of an op that raised. A dead engine is not the request's fault: re-raised so
    the cycle is abandoned (nothing recorded) and runs again on a fresh engine. A full disk is
    said plainly (the future fails at once; the same request works once space is freed)."""
    if isinstance(exc, EngineDied):
        raise exc
    if isinstance(exc, UserInputError):
        return Outcome(error=str(exc), category=ErrorCategory.USER)
    if storage.is_out_of_space(exc):
        return Outcome(error=storage.out_of_space_message(what), category=ErrorCategory.SERVER)
    return Outcome(error=f"{type(exc).__name__}: {exc}", category=ErrorCategory.SERVER)
