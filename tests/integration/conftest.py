"""A real `lockstep serve` (embedded Redis, scheduler, gateway, engines) for the SDK tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

API_KEY = "tml-integration-test"


@dataclass
class Server:
    base_url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(data_dir: Path, *extra: str, timeout: float = 300) -> Server:
    port = _free_port()
    log_path = data_dir.parent / f"{data_dir.name}-serve.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lockstep.cli", "serve", "--port", str(port),
             "--data-dir", str(data_dir), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env,
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
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(90)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    return server.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ.setdefault("TINKER_API_KEY", API_KEY)
    os.environ["HF_HUB_OFFLINE"] = "1"
    srv = start_server(tmp_path_factory.mktemp("lockstep") / "data")
    yield srv
    code = stop_server(srv)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{srv.log()[-5000:]}"


@pytest.fixture(scope="session")
def service_client(server: Server):  # type: ignore[no-untyped-def]
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="session")
def base_model() -> str:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME
