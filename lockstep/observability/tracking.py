"""Small bounded trackers behind the metrics: tenant label slots, model owners, busy time.

Nothing here defines a metric (they are all in `metrics`); these keep label sets bounded and
compute values that a single counter cannot give directly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

OTHER = "other"  # the shared label of every owner past the cap


class Removable(Protocol):
    def remove(self, *labelvalues: Any) -> None: ...


class TenantLabels:
    """Owner ids -> a bounded set of `owner` label values.

    At most `cap` owners have series of their own; any other owner is counted under "other".
    When every slot is taken, the least recently active owner that has been idle for `idle_s`
    seconds gives its slot to the newcomer and its series are removed (Prometheus marks them
    stale), so a long-running server with tenant churn keeps following its active tenants
    without growing the label set.
    """

    def __init__(
        self, cap: int = 32, idle_s: float = 900.0, now: Callable[[], float] = time.monotonic
    ) -> None:
        if cap < 0:
            raise ValueError("cap must be >= 0")
        self.cap = cap
        self.idle_s = idle_s
        self._now = now
        self._last_seen: OrderedDict[str, float] = OrderedDict()
        self._series: dict[str, set[tuple[Removable, tuple[str, ...]]]] = {}
        self._lock = threading.Lock()

    def label(self, owner: str | None) -> str:
        """The label value for `owner` (its own id while it holds a slot, else "other")."""
        if not owner or owner == OTHER:
            return OTHER
        with self._lock:
            now = self._now()
            if owner in self._last_seen:
                self._last_seen[owner] = now
                self._last_seen.move_to_end(owner)
                return owner
            if len(self._last_seen) >= self.cap and not self._evict_idle(now):
                return OTHER
            self._last_seen[owner] = now
            return owner

    def _evict_idle(self, now: float) -> bool:
        if not self._last_seen:
            return False
        oldest, seen = next(iter(self._last_seen.items()))
        if now - seen < self.idle_s:
            return False
        del self._last_seen[oldest]
        for metric, values in self._series.pop(oldest, set()):
            metric.remove(*values)
        return True

    def track(self, label: str, metric: Removable, values: tuple[str, ...]) -> None:
        """Remember a series of `label`, to remove it when the label's slot is given away."""
        if label == OTHER:
            return
        with self._lock:
            if label in self._last_seen:
                self._series.setdefault(label, set()).add((metric, values))

    def owners(self) -> list[str]:
        with self._lock:
            return list(self._last_seen)


class HasOwner(Protocol):
    owner: str


class OwnerCache:
    """model_id -> owner, bounded (least recently used dropped first).

    Filled at submission (the owner is on every request) and, after a scheduler restart, from
    the model records in Redis, so the clock's per-tenant metrics cost no Redis read per cycle.
    """

    def __init__(self, size: int = 65536) -> None:
        self.size = size
        self._owners: OrderedDict[str, str] = OrderedDict()

    def note(self, model_id: str, owner: str) -> None:
        self._owners[model_id] = owner
        self._owners.move_to_end(model_id)
        while len(self._owners) > self.size:
            self._owners.popitem(last=False)

    def get(self, model_id: str) -> str | None:
        return self._owners.get(model_id)

    async def resolve(
        self, model_ids: Iterable[str], lookup: Callable[[str], Awaitable[HasOwner | None]]
    ) -> None:
        """Look up (once) the owners of models not seen since this process started.

        A failed lookup leaves the owner unknown (counted as "other"): metrics never fail the
        caller's work.
        """
        for model_id in model_ids:
            if model_id not in self._owners:
                try:
                    record = await lookup(model_id)
                except Exception:
                    continue
                if record is not None:
                    self.note(model_id, record.owner)


class BusyWindow:
    """The share of the last `window_s` seconds spent inside busy intervals (clock cycles).

    An interval still running counts up to now, so a long cycle shows as busy while it runs.
    Read from the metrics server's thread, written from the event loop: hence the lock.
    """

    def __init__(self, window_s: float = 60.0, now: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._now = now
        self._created = now()
        self._intervals: deque[tuple[float, float]] = deque()
        self._current: float | None = None
        self._lock = threading.Lock()

    def begin(self, start: float) -> None:
        with self._lock:
            self._current = start

    def end(self, end: float | None = None) -> float:
        """Close the running interval (if any); returns its length in seconds."""
        with self._lock:
            start, self._current = self._current, None
            if start is None:
                return 0.0
            stop = self._now() if end is None else end
            self._intervals.append((start, stop))
            return stop - start

    def ratio(self) -> float:
        with self._lock:
            now = self._now()
            since = now - self.window_s
            while self._intervals and self._intervals[0][1] <= since:
                self._intervals.popleft()
            busy = sum(min(e, now) - max(s, since) for s, e in self._intervals if e > since)
            if self._current is not None:
                busy += now - max(self._current, since)
            span = min(self.window_s, now - self._created)
            return 0.0 if span <= 0 else max(0.0, min(1.0, busy / span))
