"""When a training run's state is snapshotted: at most once per `interval_s` per model.

A snapshot (adapter + Adam moments) costs I/O per tenant — ~1 GB for a Qwen3-8B-shaped rank-32
adapter — so one per tenant per optim_step would make disk the bottleneck of a packed cycle.
Between two snapshots the replay log holds the model's passes and steps (`scheduler.state.commit`):
a restart or a page-in recomputes at most `interval_s` of that model's work, and nothing is lost.

A step that is not snapshotted stays *pending*: its snapshot is taken at the model's next step
once the interval has passed, when the clock is idle (`lagging`), or before the model leaves the
engine, so a run that stops stepping still gets its last steps snapshotted (and their results
their TTL) soon after.
"""

from __future__ import annotations

import time
from collections.abc import Container


class SnapshotCadence:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._taken: dict[str, float] = {}  # model -> monotonic time of its last snapshot
        self._pending: dict[str, int] = {}  # model -> its newest step no snapshot holds yet

    def due(self, model_id: str) -> bool:
        taken = self._taken.get(model_id)
        return taken is None or time.monotonic() - taken >= self.interval_s

    def taken(self, model_id: str) -> None:
        """A snapshot of the model's current state was just taken (or written)."""
        self._taken[model_id] = time.monotonic()
        self._pending.pop(model_id, None)

    def skipped(self, model_id: str, seq: int) -> None:
        """Step `seq` changed the model and was not snapshotted."""
        self._pending[model_id] = seq

    def failed(self, model_id: str) -> None:
        """The snapshot failed: the next step tries again (the replay log still holds it)."""
        self._taken.pop(model_id, None)
        self._pending.pop(model_id, None)

    def pending(self, model_id: str) -> int | None:
        return self._pending.get(model_id)

    def lagging(self) -> list[str]:
        """The models with a pending step that are due a snapshot."""
        return [m for m in self._pending if self.due(m)]

    def keep(self, models: Container[str]) -> None:
        """Forget models the engine no longer holds: back, they are snapshotted at their next
        step (their durable snapshot + replay log cover them meanwhile)."""
        self._taken = {m: t for m, t in self._taken.items() if m in models}
        self._pending = {m: s for m, s in self._pending.items() if m in models}
