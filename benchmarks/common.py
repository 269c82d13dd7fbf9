"""Helpers shared by the benchmarks: a real `lockstep serve`, result files, tables.

`start_server` / `stop_server` are the minimal logic of tests/integration/conftest.py (a real
`lockstep serve` on a free port, ready once `/api/v1/healthz` answers 200), without pytest.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
API_KEY = "tml-benchmark"


@dataclass
class Server:
    base_url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(data_dir: Path, *extra: str, timeout: float = 300) -> Server:
    """Start `lockstep serve --data-dir data_dir *extra` and wait until it is healthy."""
    port = free_port()
    log_path = data_dir.parent / f"{data_dir.name}-serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port),
             "--data-dir", str(data_dir), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
        )
    server = Server(f"http://127.0.0.1:{port}", data_dir, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lockstep serve exited early:\n{server.log()[-5000:]}")
        try:
            with urllib.request.urlopen(server.base_url + "/api/v1/healthz", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.3)
    stop_server(server)
    raise RuntimeError(f"lockstep serve not ready in {timeout}s:\n{server.log()[-5000:]}")


def stop_server(server: Server) -> int:
    """SIGTERM (graceful drain), then kill after 90 s. Returns the exit code."""
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(90)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    return server.proc.returncode


def environment() -> dict[str, Any]:
    """Where the numbers were taken: enough to tell two result files apart."""
    import torch

    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=REPO_ROOT, capture_output=True, text=True,
                                  check=False).stdout.rstrip()
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
