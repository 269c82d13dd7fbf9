"""Long-poll support: wake the calls waiting on a key (a request id, or a sampling session's
completion log) when something under it completes."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.outcome import Recorded
from lockstep.scheduler.state.store import Store
from lockstep.vocab import JobStatus

T = TypeVar("T")


class _Wake(asyncio.Event):
    """A wake-up, with what completed when the waker knows it (else the waiter reads it): a
    job's `Recorded` outcome, or the completions a sampling session's log just took."""

    value: object = None


class FutureBoard:
    """In-process wake-ups. A result is read from Redis (it survives restarts), except that the
    clock and the sampling lane hand what they just committed to the futures waiting on it."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._events: dict[str, _Wake] = {}
        self._waiters: defaultdict[str, int] = defaultdict(int)
        # Samples cancelled through this process so far: the sampling lane reads statuses
        # again before an engine call only if this moved since it read its batch.
        self.cancels = 0

    def waiting(self, key: str) -> int:
        """How many calls wait on `key` now."""
        return self._waiters.get(key, 0)

    def notify(self, *keys: str, value: object = None) -> None:
        # The event goes with the wake-up: a later wait on the key (a poller's next poll) waits
        # for the next completion instead of waking at once.
        for key in keys:
            event = self._events.pop(key, None)
            if event is not None:
                event.value = value
                event.set()

    def cancelled(self, *keys: str) -> None:
        """A sample was cancelled (its outcome written): count it and wake its waiters."""
        self.cancels += 1
        self.notify(*keys)

    async def wait(self, request_id: str, timeout: float) -> Job | None:
        """The job once finished, or as it stands when `timeout` runs out; None if unknown."""

        def finished(job: Job | None, outcome: object) -> Job | None:
            if job is None or not isinstance(outcome, Recorded):
                return None
            return replace(job, **vars(outcome))

        return await self.wait_until(
            request_id,
            lambda: self.store.jobs.get(request_id, payload=False),
            lambda job: job is None or job.status != JobStatus.PENDING,
            timeout,
            finished,
        )

    async def wait_until(
        self,
        key: str,
        read: Callable[[], Awaitable[T]],
        done: Callable[[T], bool],
        timeout: float,
        finished: Callable[[T, object], T | None] | None = None,
    ) -> T:
        """`read()` once `done` holds for it, or as it stands when `timeout` runs out. With
        `finished`, a wake-up that carries what completed completes the first read instead
        (unless `finished` answers None: then it is read)."""
        # Register before reading so a completion between the read and the wait is not missed.
        event = self._events.setdefault(key, _Wake())
        self._waiters[key] += 1
        try:
            value = await read()
            if done(value) or timeout <= 0:
                return value
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                pass
            if event.is_set() and event.value is not None and finished is not None:
                handed = finished(value, event.value)
                if handed is not None:
                    return handed
            return await read()
        finally:
            self._waiters[key] -= 1
            if self._waiters[key] <= 0:
                self._waiters.pop(key, None)
                self._events.pop(key, None)
