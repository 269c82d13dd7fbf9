"""Residency: which training runs the training engine holds, in LRU order, and when to let go.

Engine memory is disposable (docs/ARCHITECTURE.md, "Durability and recovery"): a model's latest
snapshot plus its replay log rebuild it bit for bit, and `Dispatcher.ensure_resident` does so
lazily before the model's next cycle. So freeing a model is just `TrainingEngine.delete_model`:

* freed: its session ended (closed, silent past the expiry, or the run was unloaded). Done at
  the next cycle boundary (the clock is woken for it), never while the model has work in flight.
* paged: `--max-resident-models N`. At most N models get a cycle (`admit`, before planning: the
  ones that waited longest first, so nobody starves), and before the cycle the least-recently-used
  models outside it are paged out (`make_room`). Paging in is the lazy restore above. Numbers are
  those of an unpaged run; a model only waits a cycle or so longer.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TypeVar

from lockstep.engine.interface import TrainingEngine
from lockstep.observability import metrics
from lockstep.scheduler.state.records import QueuedOp

log = logging.getLogger(__name__)

Q = TypeVar("Q", bound=Sequence[QueuedOp])


class Residency:
    def __init__(
        self,
        engine: TrainingEngine,
        max_resident: int = 0,
        before_drop: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.before_drop = before_drop  # the model's last state leaves a snapshot behind
        self.max_resident = max_resident  # 0: no limit (only ended models are freed)
        self._lru: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._ended: set[str] = set()  # to free once they have no queued work
        self._queued: set[str] = set()  # models with queued work (as of the last admit)
        self._waited: dict[str, int] = {}  # admission: cycles a ready model was left out
        self.page_ins = 0
        self.page_outs = 0

    # --- the set the dispatcher reads and writes (`in`, add, clear)
    def __contains__(self, model_id: object) -> bool:
        return model_id in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def add(self, model_id: str) -> None:
        self._lru[model_id] = None
        self._lru.move_to_end(model_id)
        metrics.residency(len(self._lru))

    def discard(self, model_id: str) -> None:
        """The engine's copy of the model is no longer trusted (a failed snapshot rolled it
        back): restore it from its durable state before its next op."""
        self._lru.pop(model_id, None)
        metrics.residency(len(self._lru))

    def clear(self) -> None:
        """The engine restarted: it holds nothing."""
        self._lru.clear()
        metrics.residency(0)

    def paged_in(self, model_id: str, seconds: float) -> None:
        self.page_ins += 1
        self.add(model_id)
        metrics.residency(len(self._lru), "in", seconds)
        log.info("model %s paged in of the training engine in %.4f s", model_id, seconds)

    # --- lifecycle
    def end(self, model_ids: Iterable[str]) -> None:
        """Free these models' engine state once they have no queued work (work accepted before
        the end still runs, restoring a paged-out model if needed). Their durable state stays:
        a later request of a still-valid session restores it."""
        self._ended.update(model_ids)

    async def free_ended(self, busy: Iterable[str] = ()) -> list[str]:
        """At a cycle boundary: delete every ended model with no queued work (and none in
        `busy`, this cycle's models) from the engine."""
        keep = set(busy) | self._queued
        done = [m for m in self._ended if m not in keep]
        freed = [m for m in done if m in self._lru]
        for model_id in freed:
            await self._drop(model_id, "freed")
        self._ended.difference_update(done)
        return freed

    # --- paging
    def admit(self, queues: Mapping[str, Q], next_seq: Mapping[str, int]) -> dict[str, Q]:
        """The queues the planner may use this cycle: all of them without a limit; else at most
        `max_resident` ready models, those left out longest first (residents win ties)."""
        self._queued = {m for m, ops in queues.items() if ops}
        if not self.max_resident or len(queues) <= self.max_resident:
            self._waited.clear()
            return dict(queues)
        ready = [m for m, ops in queues.items() if ops and ops[0].seq_id == next_seq.get(m, 0)]
        ready.sort(key=lambda m: (-self._waited.get(m, 0), m not in self._lru))
        chosen = set(ready[: self.max_resident])
        for m in ready:
            self._waited[m] = 0 if m in chosen else self._waited.get(m, 0) + 1
        return {m: ops for m, ops in queues.items() if m in chosen}

    async def make_room(self, cycle_models: Sequence[str]) -> None:
        """Before a cycle: page out least-recently-used models outside it until the cycle's
        models fit in `max_resident` (the planner never admits more than fit)."""
        for m in cycle_models:
            if m in self._lru:
                self._lru.move_to_end(m)
        if not self.max_resident:
            return
        incoming = sum(m not in self._lru for m in cycle_models)
        busy = set(cycle_models)
        while len(self._lru) + incoming > self.max_resident:
            victim = next((m for m in self._lru if m not in busy), None)
            if victim is None:
                break
            await self._drop(victim, "out")
            self.page_outs += 1

    async def _drop(self, model_id: str, direction: str) -> None:
        if self.before_drop is not None:
            await self.before_drop(model_id)
        with metrics.engine_call("trainer", "delete_model"):
            await asyncio.to_thread(self.engine.delete_model, model_id)
        self._lru.pop(model_id, None)
        metrics.residency(len(self._lru), direction)
        log.info("model %s %s of the training engine", model_id, direction)
