"""The demo's live terminal view and the scheduler figures it shows.

Cycle figures come from the scheduler's own Prometheus endpoint (the numbers an operator's
dashboard shows): a poller scrapes it twice a second and turns counter deltas into one row per
interval that had cycles (a row of one cycle is that cycle exactly; more are averaged).
"""

from __future__ import annotations

import math
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

from lockstep.demo.tenants import Tenant


@dataclass(frozen=True)
class ClockFigures:
    """Cumulative clock counters read from one scrape."""

    at: float = 0.0
    cycles: float = 0.0  # cycles with work
    shared: float = 0.0  # cycles with work for two tenants or more
    tenant_sum: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0  # summed duration of all cycles
    counted: float = 0.0  # cycles timed (idle ones too under the periodic policy)
    busy_ratio: float = 0.0

    def plus(self, o: ClockFigures) -> ClockFigures:
        """Two intervals' figures added (the latest busy ratio kept)."""
        return ClockFigures(
            self.at + o.at,
            self.cycles + o.cycles,
            self.shared + o.shared,
            self.tenant_sum + o.tenant_sum,
            self.tokens + o.tokens,
            self.seconds + o.seconds,
            self.counted + o.counted,
            o.busy_ratio,
        )

    def minus(self, o: ClockFigures) -> ClockFigures:
        return ClockFigures(
            self.at - o.at,
            self.cycles - o.cycles,
            self.shared - o.shared,
            self.tenant_sum - o.tenant_sum,
            self.tokens - o.tokens,
            self.seconds - o.seconds,
            self.counted - o.counted,
            self.busy_ratio,
        )


def scrape(url: str) -> ClockFigures:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.labels.get("kind") or s.labels.get("le") or ""
            values[(s.name, key)] = s.value
    tenant_cycles = values.get(("lockstep_cycle_tenants_count", ""), 0.0)
    return ClockFigures(
        at=time.monotonic(),
        cycles=values.get(("lockstep_cycles_total", "work"), 0.0),
        shared=tenant_cycles - values.get(("lockstep_cycle_tenants_bucket", "1.0"), 0.0),
        tenant_sum=values.get(("lockstep_cycle_tenants_sum", ""), 0.0),
        tokens=values.get(("lockstep_cycle_tokens_total", ""), 0.0),
        seconds=values.get(("lockstep_cycle_duration_seconds_sum", ""), 0.0),
        counted=values.get(("lockstep_cycle_duration_seconds_count", ""), 0.0),
        busy_ratio=values.get(("lockstep_clock_busy_ratio", ""), 0.0),
    )


class ClockPoller:
    """Scrapes the scheduler's /metrics in a thread; keeps the latest rows for the view."""

    def __init__(self, url: str, interval_s: float = 0.5, rows: int = 8) -> None:
        self.url = url
        self.interval_s = interval_s
        self.rows: deque[ClockFigures] = deque(maxlen=rows)
        self.latest = scrape(url)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="demo-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                now = scrape(self.url)
            except OSError:
                continue
            delta = now.minus(self.latest)
            if delta.counted > 0:
                self.rows.append(delta)
            self.latest = now


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def render(title: str, phase: str, tenants: list[Tenant], poller: ClockPoller) -> Group:
    people = Table(title="tenants", title_justify="left", expand=False)
    for col in ("tenant", "task", "rank", "step", "loss / reward", "cycle", "s/step"):
        people.add_column(col, justify="left" if col in ("tenant", "task") else "right")
    for t in tenants:
        last = t.latest
        steps = len(t.warmup) + len(t.steps) + len(t.solo)
        people.add_row(
            t.name,
            t.task.value,
            str(t.rank),
            str(steps),
            f"{t.value_name} {_fmt(last.value)}" if last else "-",
            str(last.cycle) if last else "-",
            f"{last.seconds:.2f}" if last else "-",
        )
    cycles = Table(title="clock cycles (scheduler /metrics)", title_justify="left")
    for col in ("cycles", "tenants/cycle", "tokens/cycle", "ms/cycle", "busy ratio (60 s)"):
        cycles.add_column(col, justify="right")
    for row in poller.rows:
        n = max(row.cycles, 1.0)
        cycles.add_row(
            f"{row.cycles:.0f}",
            f"{row.tenant_sum / n:.1f}",
            f"{row.tokens / n:.0f}",
            f"{1000 * row.seconds / max(row.counted, 1.0):.0f}",
            f"{row.busy_ratio:.2f}",
        )
    total = poller.latest
    footer = Text(
        f"cycles so far: {total.cycles:.0f}, shared by 2+ tenants: {total.shared:.0f}",
        style="dim",
    )
    return Group(Text(f"{title}  ·  {phase}", style="bold"), people, cycles, footer)
