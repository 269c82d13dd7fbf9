"""The clock as the console shows it: the scheduler's /metrics, scraped on demand.

Scrapes are kept for a short window (at most one a second, however many pages poll), and the
figures shown are the rates between the newest scrape and the oldest one still in the window
(about `WINDOW_S` seconds), so every viewer sees the same numbers and the scheduler is scraped
about once a second while anyone watches, never otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httpx

from lockstep.observability.clock_figures import ClockFigures, ClockRates, clock_figures

WINDOW_S = 10.0  # the interval the rates are taken over
MIN_INTERVAL_S = 1.0  # the most often the scheduler is scraped
SCRAPE_TIMEOUT_S = 2.0


class ClockWatch:
    def __init__(self, url: str | None) -> None:
        self.url = url
        self.scrapes: deque[ClockFigures] = deque()
        self.error: str | None = None
        self._lock = asyncio.Lock()

    async def rates(self) -> ClockRates | None:
        """The clock over the last window (None: no metrics URL, or no scrape answered)."""
        if self.url is None:
            return None
        async with self._lock:
            now = time.monotonic()
            if not self.scrapes or now - self.scrapes[-1].at >= MIN_INTERVAL_S:
                await self._scrape(self.url)
            while len(self.scrapes) > 2 and now - self.scrapes[1].at >= WINDOW_S:
                self.scrapes.popleft()
        if not self.scrapes:
            return None
        return ClockRates.between(self.scrapes[0], self.scrapes[-1])

    async def _scrape(self, url: str) -> None:
        try:
            async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as client:
                resp = await client.get(url)
                resp.raise_for_status()
        except httpx.HTTPError as exc:
            self.error = f"the scheduler's metrics at {url} did not answer: {exc}"
            return
        self.error = None
        self.scrapes.append(clock_figures(resp.text))
