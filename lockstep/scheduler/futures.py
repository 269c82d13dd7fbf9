"""Long-poll support: wake the RetrieveFuture calls waiting on a request when it completes."""

from __future__ import annotations

import asyncio
from collections import defaultdict

from lockstep.scheduler.store import Job, Store
from lockstep.vocab import JobStatus


class FutureBoard:
    """In-process wake-ups; the result itself always comes from Redis (it survives restarts)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._events: dict[str, asyncio.Event] = {}
        self._waiters: defaultdict[str, int] = defaultdict(int)

    def notify(self, request_id: str) -> None:
        event = self._events.get(request_id)
        if event is not None:
            event.set()

    async def wait(self, request_id: str, timeout: float) -> Job | None:
        """The job once finished, or as it stands when `timeout` runs out; None if unknown."""
        # Register before reading so a completion between the read and the wait is not missed.
        event = self._events.setdefault(request_id, asyncio.Event())
        self._waiters[request_id] += 1
        try:
            job = await self.store.job(request_id, payload=False)
            if job is None or job.status != JobStatus.PENDING or timeout <= 0:
                return job
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                pass
            return await self.store.job(request_id, payload=False)
        finally:
            self._waiters[request_id] -= 1
            if self._waiters[request_id] <= 0:
                self._waiters.pop(request_id, None)
                self._events.pop(request_id, None)
