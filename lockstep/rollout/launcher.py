"""Start, watch and stop an inference server process (vLLM or SGLang) that Lockstep manages,
and what both servers are started with (`LaunchConfig`).

The engine object owns its server process (no extra supervisor child): the scheduler's health
check asks `alive()`, and a dead server is relaunched by the engine's `restart()`, the same way
the sampling lane restarts a crashed local sampler.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import httpx

log = logging.getLogger(__name__)


def _own_group_dies_with_parent() -> None:
    """In the child: a process group of its own (stopped as a whole), and SIGTERM when the
    process that started it dies, so a killed scheduler leaves no orphan server behind.
    (Linux ties this to the starting thread: start servers from a long-lived thread.)"""
    os.setsid()
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerProcess:
    """`argv` run in its own session, its output appended to `log_file`, healthy when
    GET `health_path` answers 200."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        url: str,
        health_path: str,
        env: dict[str, str],
        log_file: Path,
        start_timeout_s: float = 600,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.health_path = health_path
        self.env = env
        self.log_file = log_file
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with self.log_file.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                preexec_fn=_own_group_dies_with_parent,
            )
        log.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        deadline = started + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while "
                    f"starting; last log lines:\n{self.tail()}"
                )
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    log.info(
                        "%s healthy at %s after %.1fs",
                        self.name,
                        self.url,
                        time.monotonic() - started,
                    )
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(
            f"{self.name} not healthy within {self.start_timeout_s:.0f}s:\n{self.tail()}"
        )

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # The server forks workers (engine core, tokenizer pools): signal the whole group.
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class LaunchConfig(ABC):
    """How Lockstep starts an inference server: what every kind takes; a subclass adds its own
    flags and environment."""

    server: ClassVar[str]  # its name in logs and errors ("vllm", "sglang")

    python: Path  # the interpreter of an environment with the server installed
    model_dir: Path
    served_name: str
    max_loras: int = 4  # adapters in one batch; also Lockstep's slot count
    max_lora_rank: int = 64
    port: int = 0  # 0: a free port
    log_file: Path = Path("sampler.log")
    extra_args: tuple[str, ...] = ()

    @abstractmethod
    def argv(self, port: int) -> list[str]:
        """The server's command line."""

    def common_args(self, port: int) -> list[str]:
        """Flags both servers spell alike: name, loopback address, fp32 like the trainer (so
        sampled logprobs equal forward's), multi-LoRA and its largest rank."""
        return [
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
        ]

    def env(self) -> dict[str, str]:
        """Offline, and none of Lockstep's own Python environment leaking into the server's."""
        return {"HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "VIRTUAL_ENV": ""}

    def process(self, port: int) -> ServerProcess:
        url = f"http://127.0.0.1:{port}"
        return ServerProcess(
            self.server, self.argv(port), url, "/health", self.env(), self.log_file
        )
