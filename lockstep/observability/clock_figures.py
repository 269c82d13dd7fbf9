"""The clock's figures as the scheduler's Prometheus endpoint serves them: read from one scrape
(`clock_figures`), and turned into the live numbers (`ClockRates`) between two scrapes. The demo's
terminal view and the console show these; nothing else computes them."""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ClockFigures:
    """Cumulative clock counters read from one scrape (and the gauges as they were then)."""

    at: float = 0.0
    cycles: float = 0.0  # cycles with work
    shared: float = 0.0  # cycles with work for two tenants or more
    tenant_sum: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0  # summed duration of all cycles
    counted: float = 0.0  # cycles timed (idle ones too under the periodic policy)
    busy_ratio: float = 0.0
    queued: float = 0.0  # training requests queued, every owner's (a gauge)

    def plus(self, o: ClockFigures) -> ClockFigures:
        """Two intervals' figures added (the latest gauges kept)."""
        return ClockFigures(
            self.at + o.at,
            self.cycles + o.cycles,
            self.shared + o.shared,
            self.tenant_sum + o.tenant_sum,
            self.tokens + o.tokens,
            self.seconds + o.seconds,
            self.counted + o.counted,
            o.busy_ratio,
            o.queued,
        )

    def minus(self, o: ClockFigures) -> ClockFigures:
        """The interval since `o` (this scrape's gauges kept)."""
        return ClockFigures(
            self.at - o.at,
            self.cycles - o.cycles,
            self.shared - o.shared,
            self.tenant_sum - o.tenant_sum,
            self.tokens - o.tokens,
            self.seconds - o.seconds,
            self.counted - o.counted,
            self.busy_ratio,
            self.queued,
        )


def clock_figures(text: str, at: float | None = None) -> ClockFigures:
    """The figures of one scrape of the scheduler's /metrics (Prometheus text format)."""
    values: dict[tuple[str, str], float] = {}
    queued = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "lockstep_queue_depth":
                queued += s.value
            key = s.labels.get("kind") or s.labels.get("le") or ""
            values[(s.name, key)] = s.value
    tenant_cycles = values.get(("lockstep_cycle_tenants_count", ""), 0.0)
    return ClockFigures(
        at=time.monotonic() if at is None else at,
        cycles=values.get(("lockstep_cycles_total", "work"), 0.0),
        shared=tenant_cycles - values.get(("lockstep_cycle_tenants_bucket", "1.0"), 0.0),
        tenant_sum=values.get(("lockstep_cycle_tenants_sum", ""), 0.0),
        tokens=values.get(("lockstep_cycle_tokens_total", ""), 0.0),
        seconds=values.get(("lockstep_cycle_duration_seconds_sum", ""), 0.0),
        counted=values.get(("lockstep_cycle_duration_seconds_count", ""), 0.0),
        busy_ratio=values.get(("lockstep_clock_busy_ratio", ""), 0.0),
        queued=queued,
    )


@dataclass(frozen=True)
class ClockRates:
    """The clock over an interval: what the console's clock shows."""

    seconds: float  # the interval's length
    cycles: float  # cycles with work in it
    cycles_per_second: float
    tenants_per_cycle: float | None  # None: no cycle ran
    tokens_per_cycle: float | None
    ms_per_cycle: float | None
    busy_ratio: float  # the scheduler's own gauge (its last 60 s)
    queued: float  # training requests queued now
    total_cycles: float  # since the scheduler started

    @classmethod
    def between(cls, older: ClockFigures, newer: ClockFigures) -> ClockRates:
        d = newer.minus(older)
        span = max(d.at, 1e-9)
        n = d.cycles
        return cls(
            seconds=d.at,
            cycles=n,
            cycles_per_second=n / span,
            tenants_per_cycle=d.tenant_sum / n if n > 0 else None,
            tokens_per_cycle=d.tokens / n if n > 0 else None,
            ms_per_cycle=1000 * d.seconds / d.counted if d.counted > 0 else None,
            busy_ratio=newer.busy_ratio,
            queued=newer.queued,
            total_cycles=newer.cycles,
        )
