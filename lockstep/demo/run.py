"""Run the demo: start the embedded server, train the tenants together and one after another.

Each tenant takes `steps` steps together with the others (their requests share clock cycles)
and `steps` steps one after another (each in turn with the server to itself): the same tenants,
steps and tokens both ways, against the same warm server. The two ways take turns in blocks,
together - alone - alone - together, so a change in the machine's load over the run (other
work starting or stopping) falls on both alike; each way's time is the sum of its blocks.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.live import Live
from rich.table import Table

from lockstep.config import LockstepConfig
from lockstep.config.flags import replace_paths
from lockstep.demo.tenants import StepRecord, Tenant, make_tenants
from lockstep.demo.view import ClockPoller, render, scrape
from lockstep.observability.clock_figures import ClockFigures
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
    together_s: float  # wall time of the together blocks
    one_after_another_s: float  # wall time of the one-after-another blocks (the same steps)
    cycles_together: int  # cycles with work in the together blocks (scheduler metrics)
    cycles_shared: int  # of those, cycles that ran two tenants or more
    tenants_per_cycle: float
    cycles_one_after_another: int  # cycles with work in the one-after-another blocks
    pass_cycles_shared: int  # forward_backward cycle ids reported to two tenants or more
    base_model_bytes: int  # the base model's weight files: one copy serves every tenant
    speedup: float  # one_after_another_s / together_s


class Way(StrEnum):
    TOGETHER = "together"
    ALONE = "one after another"


def blocks(steps: int) -> list[tuple[Way, int]]:
    """The two ways in turns, together - alone - alone - together, `steps` steps each way."""
    first, second = (steps + 1) // 2, steps // 2
    order = [(Way.TOGETHER, first), (Way.ALONE, first), (Way.ALONE, second)]
    return [b for b in [*order, (Way.TOGETHER, second)] if b[1] > 0]


def base_model_bytes(model_dir: Path | None) -> int:
    """The size of the base model's weight files (what each engine loads once for everyone)."""
    if model_dir is None:
        return 0
    suffixes = (".safetensors", ".bin", ".pt", ".pth")
    return sum(f.stat().st_size for f in model_dir.rglob("*") if f.name.endswith(suffixes))


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
        base_bytes: int = 0,
    ) -> None:
        self.console = console
        self.base_url = base_url
        self.model = model
        self.tenants = tenants
        self.steps = steps
        self.base_bytes = base_bytes
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
        seconds = {way: 0.0 for way in Way}
        clock = {way: ClockFigures() for way in Way}
        with pool, live:
            self.phase = "creating the LoRA training runs"
            self._run_each(live, pool, lambda t: t.connect(self.base_url, self.model))

            # One untimed step each first: the first pass of a new adapter pays one-off costs
            # that would otherwise count against whichever way runs first.
            self.phase = "warm-up: one step each"
            self._run_each(live, pool, lambda t: t.warmup.append(t.step()))

            for way, n in blocks(self.steps):
                before = scrape(self.poller.url)
                start = time.monotonic()
                if way is Way.TOGETHER:
                    self.phase = f"together: {n} steps each, sharing clock cycles"
                    self._watch(
                        live, [pool.submit(self._steps, t, n, t.steps) for t in self.tenants]
                    )
                else:
                    for t in self.tenants:
                        self.phase = f"one after another: {t.name} runs {n} steps alone"
                        self._watch(live, [pool.submit(self._steps, t, n, t.solo)])
                seconds[way] += time.monotonic() - start
                clock[way] = clock[way].plus(scrape(self.poller.url).minus(before))

            self.phase = "greedy samples"
            self._run_each(live, pool, lambda t: t.sample_greedy())
            self.phase = "done"
            live.update(render(self.title, self.phase, self.tenants, self.poller))
        return self._summary(seconds, clock)

    @staticmethod
    def _steps(t: Tenant, n: int, into: list[StepRecord]) -> None:
        for _ in range(n):
            into.append(t.step())

    def _summary(self, seconds: dict[Way, float], clock: dict[Way, ClockFigures]) -> Summary:
        rows = [
            TenantSummary(
                t.name,
                t.task.value,
                t.rank,
                len(t.warmup) + len(t.steps) + len(t.solo),
                t.warmup[0].value,
                t.latest.value if t.latest else float("nan"),
                sum(s.seconds for s in t.steps) / len(t.steps),
                sum(s.seconds for s in t.solo) / len(t.solo),
                t.greedy,
            )
            for t in self.tenants
        ]
        seen = Counter(cycle for t in self.tenants for cycle in {s.cycle for s in t.steps})
        together = clock[Way.TOGETHER]
        return Summary(
            tenants=rows,
            together_s=seconds[Way.TOGETHER],
            one_after_another_s=seconds[Way.ALONE],
            cycles_together=int(together.cycles),
            cycles_shared=int(together.shared),
            tenants_per_cycle=together.tenant_sum / max(together.cycles, 1.0),
            cycles_one_after_another=int(clock[Way.ALONE].cycles),
            pass_cycles_shared=sum(1 for n in seen.values() if n >= 2),
            base_model_bytes=self.base_bytes,
            speedup=seconds[Way.ALONE] / max(seconds[Way.TOGETHER], 1e-9),
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
    for line in what_sharing_gave(s):
        console.print(line)
    console.print("greedy samples:", style="bold")
    for t in s.tenants:
        console.print(f"  {t.name:<10} {t.greedy}", markup=False, highlight=False)


def what_sharing_gave(s: Summary) -> list[str]:
    """The summary's closing lines: memory, cycles and time, as measured on this machine."""
    n = len(s.tenants)
    mb = s.base_model_bytes / 1e6
    lines = [
        "[bold]what sharing gave on this machine[/bold]",
        f"  memory: each engine holds one copy of the base model ({mb:.1f} MB of weights) for all "
        f"{n} tenants' adapters; a server per tenant would load it {n} times ({n * mb:.1f} MB)",
        f"  cycles: together {s.cycles_together} ({s.cycles_shared} shared by 2+ tenants, "
        f"{s.tenants_per_cycle:.1f} tenants per cycle; {s.pass_cycles_shared} forward_backward "
        f"cycles reported to 2+ tenants); one after another {s.cycles_one_after_another}",
    ]
    timing = (
        f"together {s.together_s:.1f} s vs one after another {s.one_after_another_s:.1f} s "
        f"(the same steps each way, measured in turns in this run)"
    )
    if s.speedup >= 1.0:
        lines.append(
            f"  [bold]time: {timing}: sharing saved {s.one_after_another_s - s.together_s:.1f} s "
            f"({s.speedup:.2f}x)[/bold]"
        )
    else:
        lines.append(
            f"  [bold]time: {timing}: no time saved here ({s.speedup:.2f}x)[/bold]: this "
            "machine's engine is compute-bound, so the tenants' tokens take as long in one pass "
            "as in several; the time win is on a GPU, where one tenant's pass leaves the device "
            "mostly idle (benchmarks/gpu_suite.py: 8 tenants packed vs one tenant per cycle)"
        )
    return lines


def run_demo(
    cfg: LockstepConfig,
    steps: int,
    tenants: int = 3,
    summary_json: Path | None = None,
    vision: bool = False,
    stay: bool = False,
) -> int:
    cfg.data_dir.mkdir(parents=True, exist_ok=True)
    server_log = cfg.data_dir / "demo-serve.log"
    # The demo's own admin key (the tenants have their own): the console shows every tenant.
    console_key = f"tml-demo-console-{secrets.token_hex(6)}"
    admin_keys = (*cfg.gateway.admin_keys, console_key)
    sup = Supervisor(replace_paths(cfg, {("gateway", "admin_keys"): admin_keys}))
    with terminal_for_us(server_log) as console:
        console.print(f"server output: {server_log}", style="dim")
        try:
            with console.status("starting Lockstep: Redis, scheduler, trainer, sampler, gateway"):
                sup.start()
                sup.wait_ready()
            console.print(
                f"console: {sup.console_url} (API key {console_key}: sees every tenant)",
                style="bold",
                markup=False,
            )
            demo = Demo(
                console,
                f"http://{sup.host}:{sup.port}",
                cfg.model.served_names[0],
                f"http://127.0.0.1:{sup.metrics_port}/metrics",
                make_tenants(tenants, vision),
                steps,
                base_model_bytes(cfg.model.dir),
            )
            summary = demo.run()
            print_summary(console, summary)
            if summary_json is not None:
                summary_json.write_text(json.dumps(asdict(summary), indent=2))
            if not stay:
                return 0
            # As `lockstep serve` runs: children kept up, Ctrl-C or SIGTERM stops them.
            signal.signal(signal.SIGTERM, sup.request_stop)
            signal.signal(signal.SIGINT, sup.request_stop)
            console.print(f"still serving: {sup.console_url} (Ctrl-C stops it)", markup=False)
            return sup.watch()
        except Exception:
            log.exception("demo failed")
            console.print(f"[red]demo failed; see {server_log}[/red]")
            return 1
        finally:
            with console.status("stopping Lockstep"):
                sup.stop()
