"""The demo's live terminal view and the scheduler figures it shows.

Cycle figures come from the scheduler's own Prometheus endpoint (the numbers an operator's
dashboard and the console show: `observability.clock_figures`): a poller scrapes it twice a
second and turns counter deltas into one row per interval that had cycles (a row of one cycle is
that cycle exactly; more are averaged).
"""

from __future__ import annotations

import math
import threading
import urllib.request
from collections import deque

from rich.console import Group
from rich.table import Table
from rich.text import Text

from lockstep.demo.tenants import Tenant
from lockstep.observability.clock_figures import ClockFigures, clock_figures


def scrape(url: str) -> ClockFigures:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return clock_figures(resp.read().decode())


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
