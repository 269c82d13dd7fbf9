"""Run an engine in its own child process, behind the same engine interface.

The scheduler keeps its event loop free and a crashed engine does not take the scheduler down.
Calls travel over a local `multiprocessing` pipe between two processes of the same deployment
(the same trust domain, never a network socket), one call at a time, like Ray actor calls.
Every call has a deadline (`Deadline`: a base plus a share per token it carries); an engine that
misses it is wedged (a stuck kernel, a hung collective): its process is killed and the call
raises EngineDied, so the caller restarts it like any dead engine.

A device error inside a call (a CUDA device-side assert, an illegal memory access: anything
`is_device_error` names) leaves the process's accelerator context unusable, so the child
answers EngineDied and exits instead of serving another call on it: the caller restarts it
(and its poison hunt finds the request that did it, if one does it every time).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from lockstep import runtime
from lockstep.engine.capabilities import SamplerCapabilities, TrainerCapabilities
from lockstep.engine.interface import EngineDied, SamplingEngine, TrainingEngine, is_device_error
from lockstep.engine.types import (
    LoraSpec,
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassRequest,
    PassResult,
    SampleRequest,
    SampleResult,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Deadline:
    """How long an engine call may take: `base_s` + `per_token_s` x the tokens it carries
    (base_s 0: no deadline)."""

    base_s: float = 0.0
    per_token_s: float = 0.0

    def of(self, tokens: int = 0) -> float | None:
        return self.base_s + self.per_token_s * tokens if self.base_s > 0 else None


NO_DEADLINE = Deadline()
DEVICE_ERROR_EXIT = 70  # the exit status of an engine process that hit a device error
# What an engine process gets in its environment unless the operator's environment says
# otherwise. The engines share the host's cores with each other, the scheduler, the gateway and
# Redis: OpenMP's default keeps an engine's worker threads spinning after every parallel region,
# so an engine that just ran steals the cores the next call (or the control plane) needs. PASSIVE
# workers sleep instead. Only the wait changes, never the arithmetic: results are bit-identical.
ENGINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
_env_lock = threading.Lock()


@contextmanager
def engine_env() -> Iterator[None]:
    """`ENGINE_ENV` (where unset) in os.environ while a child starts: spawn copies it then, and
    OpenMP reads it when the child loads it."""
    with _env_lock:
        added = {k: v for k, v in ENGINE_ENV.items() if k not in os.environ}
        os.environ.update(added)
        try:
            yield
        finally:
            for key in added:
                os.environ.pop(key, None)


def pass_tokens(requests: Sequence[PassRequest]) -> int:
    return sum(len(d.tokens) for r in requests for d in r.data)


def sample_tokens(requests: Sequence[SampleRequest]) -> int:
    return sum(len(r.prompt) + r.num_samples * r.params.max_tokens for r in requests)


# The trainer and the local sampler: the engine processes that share the host's cores.
ENGINE_PROCESSES = 2


def share_cores() -> int:
    """Give this engine process its share of the cores (torch's intra-op threads).

    Torch's default, one thread per core in each process, oversubscribes the host as soon as
    the trainer and the sampler run at once (tenants training while others sample): an OpenMP
    region then spins waiting for a thread whose core the other process holds, and on a busy
    2-core host a tiny model's step took over 10x the CPU time. OMP_NUM_THREADS, when set,
    decides instead."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = max(1, len(os.sched_getaffinity(0)) // ENGINE_PROCESSES)
    torch.set_num_threads(threads)
    return threads


@dataclass(frozen=True)
class NamedFactory:
    """Builds `target` ("module:Class") with these arguments, in the engine's process.

    The engine's class is named, not imported: the process that starts the engine (the
    scheduler) never loads torch and transformers (seconds of start-up, memory it has no use
    for); the engine's process loads them as soon as it starts (`load`)."""

    target: str
    args: tuple[object, ...] = ()
    kwargs: dict[str, object] = field(default_factory=dict)

    def load(self) -> Callable[..., object]:
        module, _, name = self.target.partition(":")
        built: Callable[..., object] = getattr(importlib.import_module(module), name)
        return built

    def __call__(self) -> Any:  # the engine it names
        return self.load()(*self.args, **self.kwargs)


class _Engine(Protocol):
    def close(self) -> None: ...


def _serve(factory: Callable[[], _Engine], conn: Connection) -> None:
    try:
        share_cores()
        if isinstance(factory, NamedFactory):
            factory.load()  # its imports, before the go-ahead (EngineProcess `after`)
        conn.recv()  # the go-ahead
        engine = factory()
    except BaseException as exc:  # report start-up failures instead of dying silently
        conn.send((False, RuntimeError(f"engine failed to start: {exc!r}")))
        return
    runtime.settle_heap()
    conn.send((True, "ready"))
    while True:
        try:
            verb, args, kwargs = conn.recv()
        except EOFError:
            return
        if verb == "__stop__":
            engine.close()
            conn.send((True, None))
            return
        try:
            conn.send((True, getattr(engine, verb)(*args, **kwargs)))
        except Exception as exc:  # sent back and re-raised in the caller
            log.exception("engine call %s failed", verb)
            if is_device_error(exc):  # the context is broken: no call may run on it again
                conn.send((False, EngineDied(f"{verb} raised a device error ({exc}); exited")))
                logging.shutdown()  # flush what was logged; nothing else is cleaned up
                os._exit(DEVICE_ERROR_EXIT)
            conn.send((False, exc))


class EngineProcess:
    """A child process hosting one engine object built by `factory` (which must pickle).

    With `after`, the child starts at once (Python and the engine's modules load, which is most
    of an engine's start-up) but builds its engine only once `after` is done: an engine whose
    start must not overlap another's (the trainer measures the memory left to it once loaded)
    still spends its import time beside it. If `after` fails, the child is stopped and its
    error raised.
    """

    def __init__(
        self,
        factory: Callable[[], _Engine],
        name: str,
        start_timeout: float = 600,
        deadline: Deadline = NO_DEADLINE,
        after: Future[None] | None = None,
    ) -> None:
        self.name = name
        self.deadline = deadline
        self.factory = factory
        self.start_timeout = start_timeout
        self.restarts = 0
        self._lock = threading.Lock()
        self._start(after)

    def _start(self, after: Future[None] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_serve, args=(self.factory, child), name=self.name, daemon=True
        )
        with engine_env():
            self._proc.start()
        child.close()
        if after is not None:
            try:
                after.result()
            except BaseException:
                self._proc.kill()
                self._proc.join(5)
                raise
        with contextlib.suppress(OSError):  # a child already gone: recv says so below
            self._conn.send(None)  # go ahead: build the engine
        if not self._conn.poll(self.start_timeout):
            self.close()
            raise EngineDied(f"{self.name} did not start within {self.start_timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise value
        log.info("%s ready in process %s", self.name, self._proc.pid)

    def restart(self) -> None:
        """Replace a dead (or wedged) engine process by a fresh one; its state starts empty."""
        self.close()
        self.restarts += 1
        log.warning("restarting %s (restart %d)", self.name, self.restarts)
        self._start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc.is_alive()

    def call(self, verb: str, *args: object, tokens: int = 0) -> Any:  # what the verb returns
        """Run `engine.verb(*args)` in the child; `tokens` (what the call carries) sizes its
        deadline."""
        limit = self.deadline.of(tokens)
        with self._lock:
            try:
                self._conn.send((verb, args, {}))
                if limit is not None and not self._conn.poll(limit):
                    self._kill()
                    raise EngineDied(
                        f"{self.name} did not finish {verb} within {limit:.0f}s (its deadline: "
                        f"--engine-deadline + --engine-deadline-per-token x {tokens} tokens); "
                        "killed"
                    )
                ok, value = self._conn.recv()
            except (EOFError, BrokenPipeError, ConnectionResetError) as exc:
                raise EngineDied(f"{self.name} (pid {self.pid}) exited") from exc
            if isinstance(value, EngineDied):  # the child is exiting: wait until it is gone
                self._proc.join(10)
        if not ok:
            raise value
        return value

    def _kill(self) -> None:
        log.error("%s (pid %s) missed its deadline; killing it", self.name, self.pid)
        self._proc.kill()
        self._proc.join(10)

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                with self._lock:
                    self._conn.send(("__stop__", (), {}))
                    if self._conn.poll(10):
                        self._conn.recv()
            except (OSError, EOFError):
                pass
            self._proc.join(5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


class ProcessTrainingEngine(TrainingEngine):
    """A TrainingEngine whose implementation lives in a child process."""

    def __init__(
        self,
        factory: Callable[[], TrainingEngine],
        name: str = "trainer",
        deadline: Deadline = NO_DEADLINE,
    ) -> None:
        self.process = EngineProcess(factory, name, deadline=deadline)
        self._card: ModelCard = self.process.call("card")
        # Found once, at the first start: admission keeps one limit for the server's lifetime.
        self._memory: MemoryBudget = self.process.call("memory_budget")
        self._capabilities: TrainerCapabilities = self.process.call("capabilities")

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> TrainerCapabilities:
        return self._capabilities

    def memory_budget(self) -> MemoryBudget:
        return self._memory

    def alive(self) -> bool:
        return self.process.alive()

    def restart(self) -> None:
        """A fresh engine process: every adapter must be restored by the caller."""
        self.process.restart()

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        self.process.call("create_model", model_id, spec)

    def delete_model(self, model_id: str) -> None:
        self.process.call("delete_model", model_id)

    def has_model(self, model_id: str) -> bool:
        return bool(self.process.call("has_model", model_id))

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        return list(self.process.call("run_passes", requests, tokens=pass_tokens(requests)))

    def undo_parts(self, model_id: str) -> None:
        self.process.call("undo_parts", model_id)

    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        return dict(self.process.call("optim_step", requests))

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        return int(self.process.call("save_state", model_id, directory, include_optimizer))

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        spec: LoraSpec = self.process.call("load_state", model_id, directory, include_optimizer)
        return spec

    def snapshot(self, model_id: str, directory: Path) -> bool:
        return bool(self.process.call("snapshot", model_id, directory))

    def durable_snapshots(self) -> list[tuple[str, Path]]:
        return list(self.process.call("durable_snapshots"))

    def export_adapter(self, model_id: str, directory: Path) -> int:
        return int(self.process.call("export_adapter", model_id, directory))

    def serve(self, verb: str, *args: object) -> object:
        result: object = self.process.call("serve", verb, *args)
        return result

    def close(self) -> None:
        self.process.close()


class ProcessSamplingEngine(SamplingEngine):
    """A SamplingEngine whose implementation lives in a child process."""

    def __init__(
        self,
        factory: Callable[[], SamplingEngine],
        name: str = "sampler",
        deadline: Deadline = NO_DEADLINE,
        after: Future[None] | None = None,
    ) -> None:
        self.process = EngineProcess(factory, name, deadline=deadline, after=after)
        self._card: ModelCard = self.process.call("card")
        self._rows: dict[str, int] = {}  # rows of the generations running in slices
        self._capabilities: SamplerCapabilities = self.process.call("capabilities")

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> SamplerCapabilities:
        return self._capabilities

    def alive(self) -> bool:
        return self.process.alive()

    def restart(self) -> None:
        """A fresh sampler process; adapters are loaded again on demand."""
        self._rows.clear()
        self.process.restart()

    def load_adapters(self, adapters: Sequence[tuple[str, Path]]) -> None:
        self.process.call("load_adapters", list(adapters))

    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        self.process.call("load_adapter", adapter_id, directory)

    def unload_adapter(self, adapter_id: str) -> None:
        self.process.call("unload_adapter", adapter_id)

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        return list(self.process.call("sample", requests, tokens=sample_tokens(requests)))

    def sample_slice(self, requests: list[SampleRequest], steps: int) -> list[SampleResult]:
        self._rows.update((r.request_id, r.num_samples) for r in requests)
        prompts = sum(len(r.prompt) for r in requests)  # the deadline: prefill + the slice
        tokens = prompts + steps * sum(self._rows.values())
        results = list(self.process.call("sample_slice", requests, steps, tokens=tokens))
        for result in results:
            self._rows.pop(result.request_id, None)
        return results

    def close(self) -> None:
        self.process.close()
