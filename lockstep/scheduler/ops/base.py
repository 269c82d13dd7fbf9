"""What every op kind says about itself: the one base class (`Op`) and the contexts it works in.

An op's life has three places, and its module holds its rules for each:

    submission  `admit`: validate the request against the scheduler's state and say what to
                queue (a `Claim`, a `SampleClaim` or a `Hold`); `addressed` and `identity`
                say which seq_id it takes and what a retry must repeat
    planner     `phase`: where in a cycle's PRE -> PASS -> OPTIM -> POST it runs
    dispatch    how it runs: alone (`SingleOp.run`), in the ONE fused pass (`PassOp`: how its
                request is built and its result encoded) or in the ONE batched optimizer step
                (`StepOp`); its Outcome says whether it joins the replay log

Submissions, the planner and the Dispatcher look the op up (`ops.registry`) instead of
branching on its kind; the fused calls stay one engine call each over every tenant.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import ClassVar, NamedTuple, Protocol, TypeVar

from lockstep.config import Limits
from lockstep.engine.capabilities import Engines
from lockstep.engine.images import ImageReader
from lockstep.engine.interface import TrainingEngine
from lockstep.engine.types import (
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassRequest,
    PassResult,
    SampleRequest,
)
from lockstep.errors import UserInputError
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.custom_losses import CustomLosses
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import LoraRecord, ModelRecord, QueuedOp
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import AuditEvent

R = TypeVar("R")


class Phase(IntEnum):
    """Where in a cycle an op runs; a model moves through them in order, never back."""

    PRE = 0
    PASS = 1
    OPTIM = 2
    POST = 3


def new_run(
    owner: str,
    session_id: str,
    model_seq_id: int,
    base_model: str,
    lora: LoraRecord,
    user_metadata: Mapping[str, str],
) -> ModelRecord:
    """The record of a training run created now (create_model, create-via-load); its id is the
    one the SDK computes itself."""
    now = time.time()
    return ModelRecord(
        model_id=f"{session_id}:train:{model_seq_id}",
        owner=owner,
        session_id=session_id,
        base_model=base_model,
        lora=lora,
        created=now,
        last_request_time=now,
        user_metadata=dict(user_metadata),
    )


# ---------------------------------------------------------------- what admission queues
class Claim(NamedTuple):
    """A training op to queue in its model's seq_id order."""

    model_id: str
    seq_id: int
    kind: str
    tokens: int  # pass tokens (the cycle's token budget)
    new_model: ModelRecord | None = None
    decoded: PassRequest | None = None  # the validated pass, kept for dispatch
    # An existing model's session: the claim checks the model still exists and this session
    # has not ended (`SubmitContext.owned_model` read neither).
    live_session: str | None = None


class SampleClaim(NamedTuple):
    """A sample to queue for the sampling lane."""

    sampler_id: str
    seq_id: int
    num_samples: int
    live_session: str | None = None  # the sampler's session: the claim checks it is live
    decoded: SampleRequest | None = None  # the validated sample, kept for the sampling lane


class Hold(NamedTuple):
    """Nothing runs: the request only holds its seq_id, as refused (`Submissions._hold_seq`)."""

    reason: str


Admission = Claim | SampleClaim | Hold


class AuditEntry(NamedTuple):
    """What an accepted submission leaves in its owner's audit log."""

    event: AuditEvent
    details: dict[str, str]


def finite(value: float, field: str, minimum: float | None = None) -> None:
    if not math.isfinite(value):
        raise UserInputError(field, f"must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise UserInputError(field, f"must be >= {minimum}, got {value}")


def check_seq(seq_id: int) -> None:
    if seq_id < 1:
        raise UserInputError("seq_id", f"must be >= 1, got {seq_id}")


# ---------------------------------------------------------------- contexts
@dataclass(frozen=True)
class SubmitContext:
    """What admission reads: the scheduler's state and limits (built by `Submissions`)."""

    store: Store
    catalog: Catalog
    card: ModelCard
    limits: Limits
    memory: MemoryBudget  # the training engine's (TrainingEngine.memory_budget)
    data_dir: Path
    custom_losses: CustomLosses  # create_custom_loss, and what a request naming one must pass
    images: ImageReader  # judges a training input's image chunks (engine/images.py)
    engines: Engines  # what the configured engines run (engine/capabilities.py)
    sample_images: ImageReader  # judges a sample prompt's image chunks (the sampler's)

    async def owned_model(self, owner: str, model_id: str) -> ModelRecord:
        """The model a request is for, if `owner`'s (its owner and session only: see
        `Catalog.addressed_model`); its Claim names the session (`live_session`) so the claim
        checks the model is still live."""
        return await self.catalog.addressed_model(owner, model_id)


class RunContext(Protocol):
    """What an op may use while a cycle runs it (the `Dispatcher` is one)."""

    @property
    def store(self) -> Store: ...

    @property
    def engine(self) -> TrainingEngine: ...

    @property
    def data_dir(self) -> Path: ...

    @property
    def resident(self) -> Residency: ...

    async def call(self, fn: Callable[..., R], *args: object) -> R:
        """An engine verb, off the event loop and metered."""
        ...

    async def durable_snapshot(self, model_id: str, seq: int) -> None:
        """Snapshot the model's state before its op is recorded (nothing earlier to replay)."""
        ...

    async def ensure_resident(self, model_id: str) -> None:
        """Restore the model (snapshot + replay log) if the engine does not hold it."""
        ...


# ---------------------------------------------------------------- the op
class Op(ABC):
    """One op kind's rules. A module of `ops/` subclasses this (or a role below) once."""

    oneof: ClassVar[str]  # the SubmitRequest `op` field it arrives in
    kinds: ClassVar[frozenset[str]]  # the queued kinds it owns (ops.registry)
    # The engine verbs it brings beyond the contract (`engine.interface.Verb` names): admission
    # refuses it where the training engine does not serve them (its capabilities).
    verbs: ClassVar[tuple[str, ...]] = ()
    # Never runs: it only holds its seq_id in its model's order (a refused request).
    holds_only: ClassVar[bool] = False

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        """(model_id, seq_id) if the request takes a place in a model's sequence (so a refusal
        holds it); ("", 0) for one that does not (create_model, create-via-load, sample)."""
        return "", 0

    def identity(self, req: pb.SubmitRequest) -> bytes | None:
        """What a retry must repeat to count as the same request (None: its payload)."""
        return None

    @abstractmethod
    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Admission:
        """Validate the request (a UserInputError or NotFound refuses it) and say what to
        queue."""

    def audit(self, req: pb.SubmitRequest, reply: pb.SubmitReply) -> AuditEntry | None:
        """The audit entry its accepted submission leaves (None: none)."""
        return None

    def phase(self, current: Phase) -> Phase | None:
        """The phase it runs in, given its model's current phase; None = next cycle."""
        return None


class SingleOp(Op):
    """An op that runs alone, in the PRE or POST phase (create, load, save)."""

    @abstractmethod
    async def run(self, ctx: RunContext, op: QueuedOp, req: pb.SubmitRequest) -> Outcome:
        """Run it on the engine; what it produced, its result encoded (nothing is written to
        Redis here: the clock commits the Outcome)."""


class PassOp(Op):
    """An op that joins the cycle's ONE fused pass (`TrainingEngine.run_passes`)."""

    @abstractmethod
    def backward(self, kind: str) -> bool:
        """Whether its pass runs backward (accumulates gradients): then it trains tokens and a
        restore must replay it."""

    @abstractmethod
    async def decode(
        self, store: Store, images: ImageReader, request_id: str, req: pb.SubmitRequest
    ) -> PassRequest:
        """Its engine request from the stored payload (when not held decoded; replays)."""

    @abstractmethod
    def outcome(self, op: QueuedOp, result: PassResult, cycle: int) -> Outcome:
        """Its result from the fused pass (every result of a cycle carries its number)."""


class StepOp(Op):
    """An op that joins the cycle's ONE batched optimizer step (`TrainingEngine.optim_step`);
    a successful step is replayed until a snapshot covers it."""

    @abstractmethod
    def request(self, model_id: str, req: pb.SubmitRequest) -> OptimRequest:
        """Its model's share of the batched step."""

    @abstractmethod
    def outcome(self, metrics: dict[str, float], snapshot_seq: int | None) -> Outcome:
        """Its result from the step's metrics for its model (`snapshot_seq`: the state after
        it is durable already)."""
