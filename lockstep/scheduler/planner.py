"""The planner: a pure function from the queues to one `CyclePlan` (no I/O; unit-tested alone).

A model's requests run strictly in seq_id order. Within one cycle a model moves through four
phases, never backwards:

    PRE    create_model, load_state, and saves that come before any pass
    PASS   forward / forward_backward: fused with every other tenant's passes into ONE pass
    OPTIM  optim_step: batched with every other tenant's step into ONE optimizer step
    POST   saves that come after the pass or the step

So `optim_step` and `load_*` are barriers for their own model only (SkyRL calls these destructive
barriers): a pass queued after a model's optim_step waits for the next cycle, because it must see
the updated weights, while other tenants flow on. A request refused at submission (bad input)
still holds its seq_id, as "rejected", so the model's later requests are not stuck. A gap in a model's seq_ids (a request not yet
arrived) stops that model until the missing request is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from lockstep.scheduler.records import QueuedOp


class Phase(IntEnum):
    PRE = 0
    PASS = 1
    OPTIM = 2
    POST = 3


PASS_KINDS = frozenset({"forward", "forward_backward"})


@dataclass
class ModelWork:
    """One model's share of a cycle, in execution order."""

    model_id: str
    pre: list[QueuedOp] = field(default_factory=list)
    passes: list[QueuedOp] = field(default_factory=list)
    optim: QueuedOp | None = None
    post: list[QueuedOp] = field(default_factory=list)
    rejected: list[QueuedOp] = field(default_factory=list)  # refused at submission: no effect

    def ops(self) -> list[QueuedOp]:
        tail = [self.optim] if self.optim is not None else []
        return [*self.pre, *self.passes, *tail, *self.post, *self.rejected]

    @property
    def tokens(self) -> int:
        return sum(op.tokens for op in self.passes)


@dataclass(frozen=True)
class CyclePlan:
    """Everything one clock cycle does. Engines consume this; nothing else decides the order.

    models:  each model's work, in the order the fairness rule admitted them.
    budget:  the token budget the passes were packed under.
    """

    models: tuple[ModelWork, ...]
    budget: int

    @property
    def empty(self) -> bool:
        return not self.models

    @property
    def pre(self) -> list[QueuedOp]:
        """Run first, in order: creations, loads and saves that precede the fused pass."""
        return [op for w in self.models for op in w.pre]

    @property
    def passes(self) -> list[QueuedOp]:
        """Every tenant's forward / forward_backward: ONE fused pass."""
        return [op for w in self.models for op in w.passes]

    @property
    def optims(self) -> list[QueuedOp]:
        """Every optim_step of the cycle: ONE batched optimizer step, after the pass."""
        return [w.optim for w in self.models if w.optim is not None]

    @property
    def post(self) -> list[QueuedOp]:
        """Saves that follow the pass or the step (e.g. save_weights_for_sampler)."""
        return [op for w in self.models for op in w.post]

    @property
    def tokens(self) -> int:
        return sum(w.tokens for w in self.models)


def _phase_for(kind: str, current: Phase) -> Phase | None:
    """The phase an op of `kind` runs in, given the model's current phase; None = next cycle."""
    if kind in ("create_model", "load"):
        return Phase.PRE if current == Phase.PRE else None
    if kind in PASS_KINDS:
        return Phase.PASS if current <= Phase.PASS else None
    if kind == "optim_step":
        return Phase.OPTIM if current <= Phase.PASS else None
    if kind == "save":
        return Phase.PRE if current == Phase.PRE else Phase.POST
    return None


def take_model_work(
    model_id: str, ops: list[QueuedOp], next_seq: int, token_room: int, cycle_has_passes: bool
) -> ModelWork:
    """Take the longest run of `model_id`'s ops, from `next_seq` on, that fits one cycle."""
    work = ModelWork(model_id)
    phase = Phase.PRE
    expected = next_seq
    room = token_room
    for op in sorted(ops, key=lambda o: o.seq_id):
        if op.seq_id < expected:
            continue  # already executed (a stale queue entry)
        if op.seq_id != expected:
            break  # a gap: wait for the missing request
        if op.kind == "rejected":  # holds its seq_id so the model's later requests can run
            work.rejected.append(op)
            expected += 1
            continue
        target = _phase_for(op.kind, phase)
        if target is None:
            break
        if target == Phase.PASS:
            first_pass_of_cycle = not cycle_has_passes and not work.passes
            if op.tokens > room and not first_pass_of_cycle:
                break  # over budget: the rest waits (an oversized lone request still runs)
            room -= op.tokens
            work.passes.append(op)
        elif target == Phase.OPTIM:
            work.optim = op
        elif target == Phase.PRE:
            work.pre.append(op)
        else:
            work.post.append(op)
        phase = target
        expected += 1
    return work


def plan_cycle(
    queues: dict[str, list[QueuedOp]],
    next_seq: dict[str, int],
    token_budget: int,
    order: list[str] | None = None,
) -> CyclePlan:
    """Pack every model's ready work into one cycle under `token_budget` pass tokens.

    `order` is the admission order of models (fairness is decided by the caller; default: by id).
    """
    models: list[ModelWork] = []
    room = token_budget
    for model_id in order if order is not None else sorted(queues):
        ops = queues.get(model_id)
        if not ops:
            continue
        work = take_model_work(model_id, ops, next_seq.get(model_id, 0), max(room, 0),
                               cycle_has_passes=any(w.passes for w in models))
        if work.ops():
            models.append(work)
            room -= work.tokens
    return CyclePlan(models=tuple(models), budget=token_budget)
