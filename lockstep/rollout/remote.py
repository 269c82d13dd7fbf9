"""Shared machinery of the sampling engines that drive an inference server over HTTP.

`RemoteSamplingEngine` keeps what vLLM and SGLang engines have in common:

* adapter paging (`rollout/pager.py`, shared with the local sampler): at most `max_adapters`
  loaded on the server, least recently used out, reloaded on demand;
* batching: each chunk's requests (at most `max_adapters` distinct adapters) are sent
  concurrently so the server batches them;
* the server's life: `launch` (start it from a `LaunchConfig`) or `attach` (use a running one),
  `alive`, `restart`, `close`; colocated mode's `release`/`resume` bookkeeping;
* what both APIs spell alike: sampling parameters, error messages, prompt logprobs by position.

Subclasses implement the server's own verbs (`_load`, `_unload`, `_generate`, and for colocated
mode `_release_memory`, `_resume_memory`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import threading
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import httpx

from lockstep.engine.capabilities import SamplerCapabilities
from lockstep.engine.interface import EngineDied, SamplingEngine
from lockstep.engine.types import ModelCard, SampleParams, SampleRequest, SampleResult
from lockstep.errors import UserInputError
from lockstep.rollout.launcher import LaunchConfig, ServerProcess
from lockstep.rollout.pager import AdapterPager

log = logging.getLogger(__name__)
T = TypeVar("T")


def cache_salt(req: SampleRequest) -> str | None:
    """The server-side prefix-cache key of a request's KV namespace (vLLM `cache_salt`, SGLang
    `extra_key`): sessions never share cached prefixes. Hashed to fit the servers' limits
    (vLLM: <= 128 chars, no '/' or '@')."""
    if req.cache_namespace is None:
        return None
    return hashlib.sha256(req.cache_namespace.encode()).hexdigest()[:32]


class ServerError(RuntimeError):
    """The inference server refused or failed a call that is not the user's fault."""


def server_message(response: httpx.Response) -> str:
    """The error text of a server's answer, in either server's JSON shape."""
    try:
        data = response.json()
    except ValueError:
        return response.text
    if not isinstance(data, dict):
        return str(data)
    error = data.get("error")
    if isinstance(error, dict):  # vLLM: {"error": {"message": ...}}
        error = error.get("message")
    return str(data.get("error_message") or error or data.get("message") or data)


def refused(req: SampleRequest, response: httpx.Response) -> SampleResult:
    """A request the server refused as invalid: its sampling parameters are the user's."""
    return SampleResult(req.request_id, [], error=f"sampling_params: {server_message(response)}")


def sampling_fields(p: SampleParams) -> dict[str, Any]:
    """The sampling parameters both servers name alike (SGLang's per row, vLLM's per request);
    no special tokens are skipped, so the ids come back as sampled."""
    return {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "stop": list(p.stop_strings),
        "stop_token_ids": list(p.stop_tokens),
        "ignore_eos": not p.stop_at_eos,
        "skip_special_tokens": False,
    }


def fill_prompt_logprobs(
    result: SampleResult,
    req: SampleRequest,
    positions: int,
    logprob: Callable[[int], float | None],
    top: Callable[[int], list[tuple[int, float]] | None],
) -> None:
    """Set `result`'s prompt logprobs (NaN where none) and top-k per prompt position from the
    server's first `positions` rows (`logprob(pos)`, `top(pos)`: None where it has none)."""
    n = len(req.prompt)
    span = range(req.prompt_logprob_start, min(n, positions))
    if req.prompt_logprobs:
        result.prompt_logprobs = [math.nan] * n
        for pos in span:
            value = logprob(pos)
            if value is not None:
                result.prompt_logprobs[pos] = value
    k = req.topk_prompt_logprobs
    if k > 0:
        result.topk_prompt = [None] * n
        for pos in span:
            entries = top(pos)
            if entries is not None:
                result.topk_prompt[pos] = entries[:k]


class RemoteSamplingEngine(SamplingEngine):
    engine_name: ClassVar[str]  # its name in refusals and capabilities: "vllm", "sglang"

    def __init__(
        self,
        card: ModelCard,
        base_url: str,
        max_adapters: int,
        timeout_s: float = 600.0,
        max_concurrency: int = 64,
        server: ServerProcess | None = None,
    ) -> None:
        self._card = card
        self.base_url = base_url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s, connect=10.0)
        self._concurrency = max_concurrency
        self._pager = AdapterPager(max_adapters)
        self._lock = threading.RLock()  # one engine call at a time (the lane serializes anyway)
        self.server = server  # None: attached to a server someone else runs
        self._released = False  # colocated mode: the server gave its memory back

    @classmethod
    def launch(cls, config: LaunchConfig) -> Self:
        """Start the server and own it (stopped with the engine, relaunched if it dies)."""
        from lockstep.ports import free_port

        port = config.port or free_port()
        server = config.process(port)
        server.start()
        card = ModelCard.from_dir(config.model_dir, config.served_name)
        return cls(card, server.url, config.max_loras, server=server)

    @classmethod
    def attach(cls, url: str, model_dir: Path, served_name: str, max_adapters: int) -> Self:
        """Use a running server (started with multi-LoRA and runtime adapter loading on)."""
        httpx.get(url.rstrip("/") + "/health", timeout=10).raise_for_status()
        return cls(ModelCard.from_dir(model_dir, served_name), url, max_adapters)

    # -- server verbs (subclasses) -----------------------------------------------------------

    @abstractmethod
    async def _load(self, client: httpx.AsyncClient, adapter_id: str, directory: Path) -> None:
        """Load a PEFT directory on the server under `adapter_id`. Raise UserInputError if the
        directory is not a usable adapter."""

    @abstractmethod
    async def _unload(self, client: httpx.AsyncClient, adapter_id: str) -> None:
        """Unload `adapter_id` from the server (unknown ids are ignored)."""

    @abstractmethod
    async def _generate(self, client: httpx.AsyncClient, req: SampleRequest) -> SampleResult:
        """Serve one (validated) request whose adapter is loaded."""

    def _release_memory(self) -> bool:
        """Give the server's accelerator memory back; whether it did (default: it cannot)."""
        return False

    def _resume_memory(self) -> None:
        """Take the memory back after `_release_memory` returned True."""

    def release(self) -> None:
        """Colocated mode: free the server's memory before a training phase."""
        with self._lock:
            if not self._released:
                self._released = self._release_memory()

    def resume(self) -> None:
        with self._lock:
            if self._released:
                self._resume_memory()
                self._released = False

    def alive(self) -> bool:
        """Whether the server process (when this engine owns one) still runs."""
        return self.server is None or self.server.alive()

    def restart(self) -> None:
        """Relaunch a managed server that died; adapters are loaded again on demand."""
        if self.server is None:
            raise ServerError(f"the sampling server at {self.base_url} is unreachable")
        self.server.stop()
        self.server.start()
        self._forget_server_state()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()

    # -- SamplingEngine ----------------------------------------------------------------------

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> SamplerCapabilities:
        return SamplerCapabilities(self.engine_name)  # text prompts (VLMs are refused at start)

    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        """Publish `adapter_id` (load it now so its first sample does not wait)."""
        self.load_adapters([(adapter_id, Path(directory))])

    def load_adapters(self, adapters: Sequence[tuple[str, Path]]) -> None:
        """Publish several adapters in one call (every adapter one clock cycle changed)."""
        with self._lock:
            self._run(self._publish(adapters))

    def unload_adapter(self, adapter_id: str) -> None:
        with self._lock:
            if self._pager.forget(adapter_id):
                self._run(self._with_client(lambda c: self._unload(c, adapter_id)))

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        with self._lock:
            return self._run(self._sample(requests))

    def resident_adapters(self) -> list[str]:
        """Adapters loaded on the server (in no particular order)."""
        with self._lock:
            return self._pager.loaded()

    # -- internals ---------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        # Engine calls come from a worker thread (asyncio.to_thread): no loop is running here.
        try:
            return asyncio.run(coro)
        except httpx.TransportError as exc:
            if not self.alive():
                raise EngineDied(f"the sampling server at {self.base_url} exited") from exc
            raise ServerError(f"sampling server {self.base_url}: {exc!r}") from exc

    async def _with_client(self, fn: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
            return await fn(client)

    async def _publish(self, adapters: Sequence[tuple[str, Path]]) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
            for adapter_id, directory in adapters[-self._pager.max_adapters :]:
                if self._pager.is_loaded(adapter_id, directory):
                    self._pager.touch([adapter_id])
                    continue
                if self._pager.is_loaded(adapter_id):  # replaced under the same id
                    self._pager.unloaded(adapter_id)
                    await self._unload(client, adapter_id)
                self._pager.remember(adapter_id, directory)
                try:
                    await self._make_resident(client, [adapter_id])
                except UserInputError:
                    self._pager.forget(adapter_id)
                    raise
            for adapter_id, directory in adapters[: -self._pager.max_adapters]:
                self._pager.remember(adapter_id, directory)  # more than fit: loaded on demand

    async def _make_resident(self, client: httpx.AsyncClient, wanted: Sequence[str]) -> None:
        """Load every adapter of `wanted` (at most max_adapters), paging out LRU others."""
        self._pager.touch(wanted)
        for adapter_id in wanted:
            if self._pager.is_loaded(adapter_id):
                continue
            directory = self._pager.directory(adapter_id)
            for victim in self._pager.admit(adapter_id, directory, keep=wanted):
                await self._unload(client, victim)
            try:
                await self._load(client, adapter_id, directory)
            except BaseException:
                self._pager.unloaded(adapter_id)
                raise

    async def _sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        results: list[SampleResult | None] = [None] * len(requests)
        valid: list[int] = []
        for i, req in enumerate(requests):  # admitted requests: only the adapter may be gone
            if req.adapter_id is not None and not self._pager.knows(req.adapter_id):
                unknown = f"adapter_id: unknown adapter {req.adapter_id!r} (not loaded)"
                results[i] = SampleResult(req.request_id, [], error=unknown)
            else:
                valid.append(i)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
            for chunk in self._pager.chunks(requests, valid):
                adapters = sorted({a for i in chunk if (a := requests[i].adapter_id) is not None})
                runnable: list[int] = []
                failed: dict[str, str] = {}
                self._pager.touch(adapters)  # the chunk's loaded adapters must stay
                for adapter_id in adapters:
                    try:
                        await self._make_resident(client, [adapter_id])
                    except UserInputError as exc:  # a directory that vanished: its rows fail
                        failed[adapter_id] = f"adapter_id: cannot reload {adapter_id!r}: {exc}"
                for i in chunk:
                    message = failed.get(requests[i].adapter_id or "")
                    if message is None:
                        runnable.append(i)
                    else:
                        results[i] = SampleResult(requests[i].request_id, [], error=message)
                outs = await self._generate_batch(client, [requests[i] for i in runnable])
                for i, out in zip(runnable, outs, strict=True):
                    results[i] = out
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    async def _generate_batch(
        self, client: httpx.AsyncClient, requests: list[SampleRequest]
    ) -> list[SampleResult]:
        """Every request of a chunk at once, so the server batches them."""
        gate = asyncio.Semaphore(self._concurrency)

        async def one(req: SampleRequest) -> SampleResult:
            async with gate:
                return await self._generate(client, req)

        return list(await asyncio.gather(*(one(r) for r in requests)))

    def _forget_server_state(self) -> None:
        """After the server restarted: nothing is loaded there any more."""
        self._pager.unload_all()
