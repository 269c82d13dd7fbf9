"""A real `lockstep serve` in a child process, for tests, benchmarks and scripts.

`start_server` runs `python -m lockstep.cli serve` on a free loopback port with its own data dir
and returns once `/api/v1/healthz` answers 200; `stop_server` drains it with SIGTERM.

A server of the built-in model finds it already in its data dir: it is built once per process
(the same bytes in every directory, lockstep.modeling.tiny) and copied there, which spares every
further server its seconds of building.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from lockstep.ports import free_port


@dataclass
class Server:
    base_url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


_built: list[Path] = []  # this process's build of the default model
# Servers may be started side by side (a fixture's thread): one builds, the others wait for it
# (two builds at once also import transformers at once, which its lazy modules do not survive).
_build_lock = threading.Lock()


def _default_model() -> Path:
    from lockstep.modeling.tiny import ensure_default_model

    with _build_lock:
        if not _built:
            cache = Path(tempfile.mkdtemp(prefix="lockstep-default-model-"))
            atexit.register(shutil.rmtree, cache, ignore_errors=True)
            _built.append(ensure_default_model(cache))
        return _built[0]


def _seed_default_model(data_dir: Path) -> None:
    """Copy the built default model where `lockstep serve --data-dir data_dir` looks for it."""
    built = _default_model()
    target = data_dir / "models" / built.name
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".copy-", dir=target.parent))
    shutil.copytree(built, partial, dirs_exist_ok=True)
    os.rename(partial, target)  # atomic, as a build is: nothing or a complete directory


def start_server(
    data_dir: Path,
    *extra: str,
    timeout: float = 300,
    python: Path | None = None,
    port: int | None = None,
) -> Server:
    """Start `lockstep serve --data-dir data_dir *extra` and wait until it is healthy.

    `python`: the interpreter of another Lockstep installation to run instead of this one (an
    earlier release, for the upgrade test); it runs outside this checkout, so that is what it
    imports. `port`: the API port (default: a free one). Its output goes to
    `<data_dir>-serve.log` beside the data dir (`Server.log()`), appended to.
    """
    port = port or free_port()
    log_path = data_dir.parent / f"{data_dir.name}-serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    if not any(arg.split("=")[0] in ("--model", "--config") for arg in extra):
        _seed_default_model(data_dir)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if python is not None:
        env.pop("PYTHONPATH", None)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [
                str(python or sys.executable),
                "-m",
                "lockstep.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(data_dir),
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=None if python is None else data_dir.parent,
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
        time.sleep(0.1)
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
