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
still holds its seq_id, as "rejected", so the model's later requests are not stuck. A gap in a
model's seq_ids (a request not yet arrived) stops that model until the missing request comes.
Which phase an op kind takes is its own module's rule (`scheduler/ops/`, `Op.phase`).

While tenants share the clock, a pass larger than its model's pace runs in *parts* of whole
datums in consecutive cycles of that model (`Part`); the rest of the cycle's room stays for the
others. A part is its model's only pass in its cycle, nothing else of that model runs between
two parts (the model's later ops wait), and the request is committed with its last part.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import Phase
from lockstep.scheduler.state.records import QueuedOp


@dataclass(frozen=True)
class Datums:
    """What the planner knows of a pass it may split: each datum's pass tokens, and how many
    datums ran in earlier cycles (a request in parts)."""

    tokens: tuple[int, ...]
    done: int = 0

    @property
    def remaining(self) -> int:
        return sum(self.tokens[self.done :])


@dataclass(frozen=True)
class Part:
    """The datums [start, stop) of a request of `count` datums that run in this cycle."""

    start: int
    stop: int
    count: int

    @property
    def final(self) -> bool:
        """Its request completes with this part (and is committed in this cycle)."""
        return self.stop == self.count


@dataclass
class ModelWork:
    """One model's share of a cycle, in execution order."""

    model_id: str
    pre: list[QueuedOp] = field(default_factory=list)
    passes: list[QueuedOp] = field(default_factory=list)
    optim: QueuedOp | None = None
    post: list[QueuedOp] = field(default_factory=list)
    rejected: list[QueuedOp] = field(default_factory=list)  # refused at submission: no effect
    # The request of `passes` whose part in this cycle is not its last: it runs but is not
    # committed (its model's progress stays before it).
    open: str | None = None

    def ops(self) -> list[QueuedOp]:
        """Every op of this model the cycle commits, in seq_id order: the order their results
        are committed, so a model's progress only ever moves forward."""
        tail = [self.optim] if self.optim is not None else []
        return sorted(
            (
                op
                for op in [*self.pre, *self.passes, *tail, *self.post, *self.rejected]
                if op.request_id != self.open
            ),
            key=lambda op: op.seq_id,
        )

    def runs(self) -> list[QueuedOp]:
        """Every op of this model the cycle runs: those it commits and an open part."""
        return [*self.ops(), *(op for op in self.passes if op.request_id == self.open)]

    @property
    def tokens(self) -> int:
        return sum(op.tokens for op in self.passes)


@dataclass(frozen=True)
class CyclePlan:
    """Everything one clock cycle does. Engines consume this; nothing else decides the order.

    models:   each model's work, in the order the fairness rule admitted them.
    budget:   the token budget of a fused pass (--token-budget, the memory bound).
    deficits: pass tokens each model that had to wait is owed in the next cycle.
    pace:     the most pass tokens one model could pack in this cycle (the clock's pace while
              tenants share it; else the budget).
    parts:    request id -> its part in this cycle, for every request run in parts (its
              QueuedOp in `passes` carries that part's tokens).
    """

    models: tuple[ModelWork, ...]
    budget: int
    deficits: dict[str, int] = field(default_factory=dict)
    pace: int = 0
    parts: dict[str, Part] = field(default_factory=dict)

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

    def settled(self, failed: Mapping[str, object]) -> CyclePlan:
        """The plan as it ended: a request whose open part failed (it has an outcome in
        `failed`) is committed now, with its error."""
        models = tuple(
            dataclasses.replace(w, open=None) if w.open is not None and w.open in failed else w
            for w in self.models
        )
        return dataclasses.replace(self, models=models)


def take_model_work(model_id: str, ops: list[QueuedOp], next_seq: int) -> ModelWork:
    """The longest run of `model_id`'s ops, from `next_seq` on, that fits one cycle's phases."""
    work = ModelWork(model_id)
    phase = Phase.PRE
    expected = next_seq
    for op in sorted(ops, key=lambda o: o.seq_id):
        if op.seq_id < expected:
            continue  # already executed (a stale queue entry)
        if op.seq_id != expected:
            break  # a gap: wait for the missing request
        rules = registry.queued_as(op.kind)  # its phase is its op's rule (scheduler/ops/)
        if rules is None:
            break  # a kind no cycle runs
        if rules.holds_only:  # refused: holds its seq_id so the model's later requests can run
            work.rejected.append(op)
            expected += 1
            continue
        target = rules.phase(phase)
        if target is None:
            break
        if target == Phase.PASS:
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


def pass_units(passes: list[QueuedOp]) -> list[list[QueuedOp]]:
    """Split a model's passes into units admitted whole: runs of one kind (forward or
    forward_backward). The chunks of one SDK call are such a run, so they share a cycle."""
    units: list[list[QueuedOp]] = []
    for op in passes:
        if units and units[-1][-1].kind == op.kind:
            units[-1].append(op)
        else:
            units.append([op])
    return units


def _cut(work: ModelWork, before_seq: int) -> ModelWork:
    """Keep only the ops before `before_seq`: the first pass that did not fit and all after it
    wait for a later cycle (in seq order, so nothing after them may run either)."""

    def keep(ops: list[QueuedOp]) -> list[QueuedOp]:
        return [o for o in ops if o.seq_id < before_seq]

    optim = work.optim if work.optim is not None and work.optim.seq_id < before_seq else None
    return ModelWork(
        work.model_id,
        keep(work.pre),
        keep(work.passes),
        optim,
        keep(work.post),
        keep(work.rejected),
    )


class _Piece(NamedTuple):
    """A model's next admission: whole ops (`ops` of them), or the next datum of a request run
    in parts (`stop`: the datum index it reaches)."""

    tokens: int
    ops: int
    stop: int | None = None


class _KeySpend:
    """Pass tokens each API key spent in the cycle being planned, against the per-key cap."""

    def __init__(self, owners: dict[str, str], cap: int) -> None:
        self.owners = owners
        self.cap = cap
        self.used: dict[str, int] = {}

    def fits(self, tokens: int) -> bool:
        """Whether a unit this size can ever fit one cycle of one key."""
        return not self.cap or tokens <= self.cap

    def room(self, model_id: str, tokens: int) -> bool:
        """Whether `model_id`'s key may spend `tokens` more. A key that spent nothing yet may
        take one request larger than its cap: it then runs alone among that key's work."""
        used = self.used.get(self.owners.get(model_id, model_id), 0)
        return not self.cap or used == 0 or used + tokens <= self.cap

    def spend(self, model_id: str, tokens: int) -> None:
        key = self.owners.get(model_id, model_id)
        self.used[key] = self.used.get(key, 0) + tokens


def plan_cycle(
    queues: dict[str, list[QueuedOp]],
    next_seq: dict[str, int],
    token_budget: int,
    deficits: dict[str, int] | None = None,
    owners: dict[str, str] | None = None,
    key_cap: int = 0,
    cycle_tokens: int | None = None,
    datums: Mapping[str, Datums] | None = None,
) -> CyclePlan:
    """Pack every model's ready work into one cycle under `token_budget` pass tokens (the memory
    bound of one fused pass). While tenants share the clock, `cycle_tokens` (its pace) caps each
    model's share: no model packs more than the pace or the next-largest model's ready passes.

    Fairness is deficit round robin over pass tokens: each model with passes waiting earns
    `budget / n` tokens per cycle on top of what it was owed (`deficits`) and is admitted whole
    units while it can pay for them, most-owed first. Leftover room then goes to whoever still
    has work (work-conserving). A unit bigger than the cycle is admitted op by op, so a run of
    calls (gradient accumulation) spreads over cycles while the others' requests go into each
    one; an op bigger than the cycle waits until its model has saved enough (the room nobody
    used is saved towards it too) and then runs in one longer cycle beside the others' usual
    share. If nothing at all fits, the most-owed model's next piece runs alone: a huge batch is
    delayed, never starved, and cannot starve others.

    Parts: `datums` gives each datum's tokens of the passes the planner may split (and of every
    request already in parts: its `done` datums ran before, its op's tokens are what is left).
    While tenants share the clock (`cycle_tokens` below `token_budget`) such a pass larger than
    the pace is admitted datum by datum like a unit op by op, and stops where its model's room
    ends: a part. A part starts its model's passes in its cycle (a request whose turn comes
    after other passes of its model waits for the next cycle), and a request in parts is its
    model's last pass in the cycle. A single datum larger than the room is a piece larger than
    the cycle (saved for, as above). A model alone never starts parts (it fills
    `token_budget`); a request already in parts goes on in parts (alone: the rest, up to the
    budget).

    `key_cap` (0 = off) caps the pass tokens of all models of one API key (`owners`: model ->
    key; a model missing there is a key of its own) in this cycle; the rest waits, owed as
    usual, so the models of one key take turns by deficit round robin too. A call larger than
    the cap is admitted op by op, and a single request larger than the cap still runs, alone
    among its key's work in its cycle: nothing starves, and other keys are not held back.
    The plan's `deficits` are what each model is owed next cycle.
    """
    datums = datums or {}
    queues = {m: [_remaining(op, datums) for op in ops] for m, ops in queues.items()}
    works = {m: take_model_work(m, ops, next_seq.get(m, 0)) for m, ops in queues.items() if ops}
    works = {m: w for m, w in works.items() if w.ops()}
    room = pace = token_budget
    splits = False
    if cycle_tokens is not None:
        # No model's passes take more of the cycle than the pace or the next-largest model's
        # ready passes: tenants of like size pack whole, a heavy one cannot make its light
        # neighbours' cycles long.
        sizes = sorted((w.tokens for w in works.values()), reverse=True)
        pace = min(token_budget, max(cycle_tokens, sizes[1] if len(sizes) > 1 else 0))
        room = max(1, sum(min(size, pace) for size in sizes))
        splits = cycle_tokens < token_budget
    packer = _DeficitRoundRobin(
        works,
        room,
        dict(deficits or {}),
        _KeySpend(owners or {}, key_cap),
        _Splits(datums, pace if splits else None),
    )
    packer.pack()
    return dataclasses.replace(packer.plan(), budget=token_budget, pace=pace)


def _remaining(op: QueuedOp, datums: Mapping[str, Datums]) -> QueuedOp:
    """A request in parts counts only its datums not run yet."""
    known = datums.get(op.request_id)
    if known is None or not known.done:
        return op
    return msgspec.structs.replace(op, tokens=known.remaining)


class _Splits:
    """Which passes run in parts, and how far each got in the cycle being planned."""

    def __init__(self, datums: Mapping[str, Datums], pace: int | None) -> None:
        self.datums = datums
        self.pace = pace  # None: nothing new splits (a model alone)
        self.stop: dict[str, int] = {}  # request id -> datum reached in this cycle

    def parted(self, op: QueuedOp) -> bool:
        """Whether `op` is admitted datum by datum (in parts)."""
        known = self.datums.get(op.request_id)
        if known is None:
            return False
        return known.done > 0 or (self.pace is not None and op.tokens > self.pace)

    def next_datum(self, op: QueuedOp) -> tuple[int, int]:
        """(tokens, index) of `op`'s next datum not yet admitted."""
        known = self.datums[op.request_id]
        at = self.stop.get(op.request_id, known.done)
        return known.tokens[at], at

    def part(self, op: QueuedOp) -> Part | None:
        """`op`'s part in this cycle (None: it runs whole, or not at all)."""
        known = self.datums.get(op.request_id)
        stop = self.stop.get(op.request_id)
        if known is None or stop is None or (known.done == 0 and stop == len(known.tokens)):
            return None
        return Part(known.done, stop, len(known.tokens))


class _DeficitRoundRobin:
    """One cycle of deficit round robin over pass tokens (see `plan_cycle`)."""

    def __init__(
        self,
        works: dict[str, ModelWork],
        budget: int,
        owed: dict[str, int],
        keyspend: _KeySpend,
        splits: _Splits,
    ) -> None:
        self.works = works
        self.keyspend = keyspend
        self.splits = splits
        self.units = {m: pass_units(w.passes) for m, w in works.items()}
        # Models with passes waiting, most-owed first.
        self.active = sorted(
            (m for m in works if self.units[m]), key=lambda m: (-owed.get(m, 0), m)
        )
        self.budget = budget  # this cycle's pass tokens
        quantum = self.budget // max(len(self.active), 1)
        self.allowance = {m: owed.get(m, 0) + quantum for m in self.active}
        self.taken: dict[str, int] = {m: 0 for m in works}  # pass ops admitted per model
        self.spent: dict[str, int] = {m: 0 for m in works}  # pass tokens admitted per model
        self.closed: set[str] = set()  # a request in parts ended: its model's passes stop
        self.room = self.budget

    def pack(self) -> None:
        for m in self.active:  # round one: each model spends what it is owed
            used = self.admit(m, min(self.allowance[m], self.room))
            self.allowance[m] -= used
            self.room -= used
        for m in self.active:  # a piece bigger than the cycle runs once its model saved for it
            piece = self.piece(m)
            if piece is None or self.spent[m] or self.taken[m]:
                continue
            if piece.tokens > self.budget and self.allowance[m] >= piece.tokens:
                if self._take(m, piece, 0, piece.tokens):
                    self.allowance[m] -= piece.tokens
        for m in self.active:  # round two: leftover room, same order
            self.room -= self.admit(m, self.room)
        saving = [m for m in self.active if self._size(m) > self.budget]
        for m in saving:  # room nobody could use pays towards the big pieces (no starving)
            self.allowance[m] += self.room // len(saving)
        if self.active and not any(self.spent[m] or self.taken[m] for m in self.active):
            first = self.active[0]  # nothing fits: the most-owed runs alone
            piece = self.piece(first)
            if piece is not None:
                self._apply(first, piece)
            self.allowance[first] = 0

    def _size(self, m: str) -> int:
        piece = self.piece(m)
        return 0 if piece is None else piece.tokens

    def piece(self, m: str) -> _Piece | None:
        """m's next admission: the rest of its current unit if the unit fits the cycle and m's
        key cap, else the unit's next op alone, or the next datum of a request in parts; None
        when all of m's passes are taken (or wait for a later cycle)."""
        if m in self.closed:
            return None
        done = self.taken[m]
        for unit in self.units[m]:
            if done >= len(unit):
                done -= len(unit)
                continue
            rest = unit[done:]
            parted = next((k for k, op in enumerate(rest) if self.splits.parted(op)), None)
            if parted == 0:
                if self.taken[m]:
                    return None  # a part starts its model's passes: the next cycle
                tokens, at = self.splits.next_datum(rest[0])
                count = len(self.splits.datums[rest[0].request_id].tokens)
                return _Piece(tokens, int(at + 1 == count), at + 1)
            rest = rest[:parted]
            whole = sum(o.tokens for o in rest)
            if whole <= self.budget and self.keyspend.fits(whole):
                return _Piece(whole, len(rest))
            return _Piece(rest[0].tokens, 1)
        return None

    def admit(self, m: str, limit: int) -> int:
        """Admit m's next pieces while they cost at most `limit` in all and fit its key's cap;
        returns tokens spent."""
        spent = 0
        while (piece := self.piece(m)) is not None:
            if not self._take(m, piece, spent, limit):
                break
            spent += piece.tokens
        return spent

    def _take(self, m: str, piece: _Piece, spent: int, limit: int) -> bool:
        if spent + piece.tokens > limit or not self.keyspend.room(m, piece.tokens):
            return False
        self._apply(m, piece)
        return True

    def _apply(self, m: str, piece: _Piece) -> None:
        if piece.stop is not None:
            op = self._next_op(m)
            self.splits.stop[op.request_id] = piece.stop
            if piece.ops and self.splits.part(op) is not None:
                self.closed.add(m)  # a request in parts is its model's last pass in a cycle
        self.taken[m] += piece.ops
        self.spent[m] += piece.tokens
        self.keyspend.spend(m, piece.tokens)

    def _next_op(self, m: str) -> QueuedOp:
        return self.works[m].passes[self.taken[m]]

    def plan(self) -> CyclePlan:
        plan: list[ModelWork] = []
        new_owed: dict[str, int] = {}
        parts: dict[str, Part] = {}
        order = {m: i for i, m in enumerate(self.active)}
        for m in sorted(self.works, key=lambda m: (m not in order, order.get(m, 0), m)):
            work = self.works[m]
            passes = work.passes
            open_part: Part | None = None
            if self.taken[m] < len(passes):
                nxt = passes[self.taken[m]]
                open_part = self.splits.part(nxt)
                work = _cut(work, nxt.seq_id + (open_part is not None))
                if open_part is not None:
                    work.open = nxt.request_id
                new_owed[m] = max(self.allowance.get(m, 0), 0)  # still waiting: keep its due
            for k, op in enumerate(work.passes):
                part = self.splits.part(op)
                if part is not None:
                    parts[op.request_id] = part
                    known = self.splits.datums[op.request_id].tokens
                    tokens = sum(known[part.start : part.stop])
                    work.passes[k] = msgspec.structs.replace(op, tokens=tokens)
            if work.ops() or work.open is not None:
                plan.append(work)
        return CyclePlan(models=tuple(plan), budget=self.budget, deficits=new_owed, parts=parts)
