"""Run the demo: start the embedded server, train the tenants together, then each alone briefly.

Phase 1 (together): every tenant runs `steps` steps at the same time, so their requests share
clock cycles. Phase 2 (alone): each tenant in turn runs `solo_steps` more steps with nobody
else on the server; its mean step time alone, times its step count, is what running the tenants
one after another would have cost, measured in the same run against the same warm server.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from lockstep.config import LockstepConfig
from lockstep.demo.tenants import Tenant, make_tenants
from lockstep.demo.view import ClockFigures, ClockPoller, render, scrape
from lockstep.supervisor import Supervisor

log = logging.getLogger("lockstep.demo")


@dataclass
class TenantSummary:
    name: str
    task: str
    rank: int
    steps: int
    first: float
    last: float
    together_s_per_step: float
    alone_s_per_step: float
    greedy: str


@dataclass
class Summary:
    tenants: list[TenantSummary]
    together_s: float  # wall time of phase 1
    one_after_another_s: float  # sum over tenants of steps x alone step time
    cycles_together: int  # cycles with work in phase 1 (scheduler metrics)
    cycles_shared: int  # of those, cycles that ran two tenants or more
    tenants_per_cycle: float
    cycles_one_after_another: float  # sum over tenants of steps x alone cycles per step
    pass_cycles_shared: int  # forward_backward cycle ids reported to two tenants or more


@contextmanager
def terminal_for_us(log_path: Path) -> Iterator[Console]:
    """Give the terminal to the live view: the server's children inherit stdout/stderr, so
    point fds 1 and 2 at a log file and draw on a duplicate of the original terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal: IO[str] = os.fdopen(os.dup(1), "w")
    with log_path.open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield Console(file=terminal)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            terminal.close()


class Demo:
    def __init__(
        self,
        console: Console,
        base_url: str,
        model: str,
        metrics_url: str,
        tenants: list[Tenant],
        steps: int,
        solo_steps: int,
    ) -> None:
        self.console = console
        self.base_url = base_url
        self.model = model
        self.tenants = tenants
        self.steps = steps
        self.solo_steps = solo_steps
        self.poller = ClockPoller(metrics_url)
        self.title = f"Lockstep demo: {len(tenants)} LoRA tenants sharing {model}"
        self.phase = ""

    def _watch(self, live: Live, futures: list[Future[None]]) -> None:
        while not all(f.done() for f in futures):
            live.update(render(self.title, self.phase, self.tenants, self.poller))
            time.sleep(0.25)
        live.update(render(self.title, self.phase, self.tenants, self.poller))
        for f in futures:
            f.result()  # raise a tenant's error here

    def _run_each(self, live: Live, pool: ThreadPoolExecutor, fn: Callable[[Tenant], None]) -> None:
        self._watch(live, [pool.submit(fn, t) for t in self.tenants])

    def run(self) -> Summary:
        self.poller.start()
        try:
            return self._run()
        finally:
            self.poller.stop()

    def _run(self) -> Summary:
        pool = ThreadPoolExecutor(max_workers=len(self.tenants))
        live = Live(console=self.console, redirect_stdout=False, redirect_stderr=False)
        with pool, live:
            self.phase = "creating the LoRA training runs"
            self._run_each(live, pool, lambda t: t.connect(self.base_url, self.model))

            # One untimed step each first: the first pass of a new adapter pays one-off costs
            # that would otherwise count against the shared phase.
            self.phase = "warm-up: one step each"
            self._run_each(live, pool, lambda t: t.warmup.append(t.step()))

            self.phase = f"together: {self.steps} steps each, sharing clock cycles"
            before = scrape(self.poller.url)
            start = time.monotonic()
            self._run_each(live, pool, self._together)
            together_s = time.monotonic() - start
            phase1 = scrape(self.poller.url).minus(before)

            alone_cycles: dict[str, float] = {}
            for t in self.tenants:
                self.phase = (
                    f"alone: {t.name} runs {self.solo_steps} steps with the server to itself"
                )
                mark = scrape(self.poller.url)
                self._watch(live, [pool.submit(self._alone, t)])
                alone_cycles[t.name] = scrape(self.poller.url).minus(mark).cycles / self.solo_steps

            self.phase = "greedy samples"
            self._run_each(live, pool, lambda t: t.sample_greedy())
            self.phase = "done"
            live.update(render(self.title, self.phase, self.tenants, self.poller))
        return self._summary(together_s, phase1, alone_cycles)

    def _together(self, t: Tenant) -> None:
        for _ in range(self.steps):
            t.steps.append(t.step())

    def _alone(self, t: Tenant) -> None:
        for _ in range(self.solo_steps):
            t.solo.append(t.step())

    def _summary(
        self, together_s: float, phase1: ClockFigures, alone_cycles: dict[str, float]
    ) -> Summary:
        rows = []
        for t in self.tenants:
            alone = sum(s.seconds for s in t.solo) / len(t.solo)
            rows.append(
                TenantSummary(
                    t.name,
                    t.task.value,
                    t.rank,
                    len(t.warmup) + len(t.steps) + len(t.solo),
                    t.warmup[0].value,
                    t.solo[-1].value,
                    sum(s.seconds for s in t.steps) / len(t.steps),
                    alone,
                    t.greedy,
                )
            )
        seen = Counter(cycle for t in self.tenants for cycle in {s.cycle for s in t.steps})
        return Summary(
            tenants=rows,
            together_s=together_s,
            one_after_another_s=sum(
                len(t.steps) * r.alone_s_per_step for t, r in zip(self.tenants, rows, strict=True)
            ),
            cycles_together=int(phase1.cycles),
            cycles_shared=int(phase1.shared),
            tenants_per_cycle=phase1.tenant_sum / max(phase1.cycles, 1.0),
            cycles_one_after_another=sum(len(t.steps) * alone_cycles[t.name] for t in self.tenants),
            pass_cycles_shared=sum(1 for n in seen.values() if n >= 2),
        )


def print_summary(console: Console, s: Summary) -> None:
    table = Table(title="summary", title_justify="left")
    for col in (
        "tenant",
        "task",
        "rank",
        "steps",
        "first -> last",
        "s/step together",
        "s/step alone",
    ):
        table.add_column(col, justify="left" if col in ("tenant", "task") else "right")
    for t in s.tenants:
        table.add_row(
            t.name,
            t.task,
            str(t.rank),
            str(t.steps),
            f"{t.first:.3f} -> {t.last:.3f}",
            f"{t.together_s_per_step:.2f}",
            f"{t.alone_s_per_step:.2f}",
        )
    console.print(table)
    saved = s.one_after_another_s - s.together_s
    console.print(
        f"cycles together: {s.cycles_together} ({s.cycles_shared} shared by 2+ tenants, "
        f"{s.tenants_per_cycle:.1f} tenants per cycle; {s.pass_cycles_shared} forward_backward "
        f"cycles reported to 2+ tenants); one after another: ~{s.cycles_one_after_another:.0f}"
    )
    verdict = "saved" if saved >= 0 else "cost"
    console.print(
        f"[bold]together {s.together_s:.1f} s vs one after another {s.one_after_another_s:.1f} s "
        f"(each tenant's steps x its step time alone, measured above): packing {verdict} "
        f"{abs(saved):.1f} s ({s.one_after_another_s / s.together_s:.2f}x)[/bold]"
    )
    console.print("greedy samples:", style="bold")
    for t in s.tenants:
        console.print(f"  {t.name:<10} {t.greedy}", markup=False, highlight=False)


def run_demo(
    cfg: LockstepConfig,
    steps: int,
    tenants: int = 3,
    solo_steps: int = 2,
    summary_json: Path | None = None,
    vision: bool = False,
) -> int:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    server_log = cfg.data_dir / "demo-serve.log"
    sup = Supervisor(cfg)
    with terminal_for_us(server_log) as console:
        console.print(f"server output: {server_log}", style="dim")
        try:
            with console.status("starting Lockstep: Redis, scheduler, trainer, sampler, gateway"):
                sup.start()
                sup.wait_ready()
            demo = Demo(
                console,
                f"http://{sup.host}:{sup.port}",
                cfg.model.served_names[0],
                f"http://127.0.0.1:{sup.metrics_port}/metrics",
                make_tenants(tenants, vision),
                steps,
                solo_steps,
            )
            summary = demo.run()
            print_summary(console, summary)
            if summary_json is not None:
                summary_json.write_text(json.dumps(asdict(summary), indent=2))
            return 0
        except Exception:
            log.exception("demo failed")
            console.print(f"[red]demo failed; see {server_log}[/red]")
            return 1
        finally:
            with console.status("stopping Lockstep"):
                sup.stop()
