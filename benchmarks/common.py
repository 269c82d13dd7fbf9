"""Helpers shared by the benchmarks: a real `lockstep serve`, result files, tables.

`start_server` / `stop_server` (lockstep.devserver, shared with the tests): a real `lockstep
serve` on a free port, ready once `/api/v1/healthz` answers 200.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The benchmarks' API, re-exported (the `as` says so to ruff and mypy).
from lockstep.devserver import Server as Server
from lockstep.devserver import start_server as start_server
from lockstep.devserver import stop_server as stop_server

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
API_KEY = "tml-benchmark"


def environment() -> dict[str, Any]:
    """Where the numbers were taken: enough to tell two result files apart."""
    import torch

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(
                ["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True, check=False
            ).stdout.rstrip()
        except OSError:
            return ""

    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "git_rev": git("rev-parse", "--short", "HEAD"),
        # Uncommitted changes under lockstep/ that the numbers were taken with.
        "git_dirty": git("status", "--porcelain", "--", "lockstep").splitlines(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "loadavg_1_5_15": list(os.getloadavg()),  # other work on the box skews the timings
    }


def settle_client_heap() -> None:
    """Once the benchmark's clients are set up: keep this process's heap out of later full
    collections, as the server's processes do (lockstep.runtime). Such a collection walks torch,
    transformers and the SDK (230 ms on a 2-core CPU), stalls every client in the process at
    once, and would be read as the server's latency."""
    from lockstep import runtime  # here: it needs uvloop, which the GPU image lacks (gpu_suite)

    runtime.settle_heap()


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def figure_path(name: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    return RESULTS_DIR / f"{name}.png"


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(fmt(v) for v in row))
    Console(width=160).print(table)


def fmt(value: object) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else ("yes" if value else "no")
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def check(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]missed[/red]"


def server_processes(pid: int) -> list[tuple[str, Any]]:
    """(role, psutil.Process) of a `lockstep serve` (pid) and everything under it: supervisor,
    gateway, scheduler, redis, engines (the trainer and sampler processes under the scheduler).
    Empty once the server is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for proc in procs:
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:  # exited meanwhile
            continue
        if proc.pid == pid:
            role = "supervisor"
        elif "lockstep.gateway" in cmd:
            role = "gateway"
        elif "lockstep.scheduler" in cmd:
            role = "scheduler"
        elif "valkey" in cmd or "redis" in cmd:
            role = "redis"
        else:
            role = "engines"
        out.append((role, proc))
    return out


def cpu_seconds_by_role(server: Server) -> dict[str, float]:
    """CPU seconds (user + system) so far of the server's processes by role (`server_processes`)
    plus this process ("client": the benchmark's SDK clients)."""
    import psutil

    out = {"client": sum(os.times()[:2])}
    for role, proc in server_processes(server.proc.pid):
        try:
            times = proc.cpu_times()
        except psutil.Error:  # exited meanwhile
            continue
        out[role] = out.get(role, 0.0) + times.user + times.system
    return out
