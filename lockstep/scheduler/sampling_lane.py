"""The sampling lane: serves asample requests on the sampling engine, beside the clock.

Samples have no ordering constraints, so they do not wait for a training cycle: whatever is queued
is taken as one batch (every tenant's adapter mixed in it) and handed to the sampling engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from lockstep.engine.interface import SamplingEngine
from lockstep.engine.types import SampleRequest
from lockstep.observability import metrics
from lockstep.scheduler import translate
from lockstep.scheduler.futures import FutureBoard
from lockstep.scheduler.store import Job, Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.process import EngineDied

log = logging.getLogger(__name__)


class SamplingLane:
    def __init__(
        self, store: Store, engine: SamplingEngine, board: FutureBoard, max_batch: int = 64,
        colocate: bool = False,
    ) -> None:
        self.store = store
        self.colocate = colocate  # sampler and trainer share one accelerator
        self.engine = engine
        self.board = board
        self.max_batch = max_batch
        self.wake = asyncio.Event()
        self._stopping = False
        self._loaded: set[str] = set()
        self._engine_lock = asyncio.Lock()

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def prefetch(self, adapter_id: str, directory: Path) -> None:
        """Publish new sampler weights without blocking the clock."""
        asyncio.get_running_loop().create_task(self._ensure_adapter(adapter_id, directory))

    def publish(self, adapters: Sequence[tuple[str, Path]]) -> None:
        """Publish every adapter one cycle changed, in one engine call, off the clock's path."""
        fresh = [(a, d) for a, d in adapters if a not in self._loaded]
        if fresh:
            asyncio.get_running_loop().create_task(self._publish_all(fresh))

    async def _publish_all(self, adapters: list[tuple[str, Path]]) -> None:
        load_many = getattr(self.engine, "load_adapters", None)
        if load_many is None:  # engines without a batch verb: one load each
            for adapter_id, directory in adapters:
                await self._ensure_adapter(adapter_id, directory)
            return
        try:
            async with self._engine_lock:
                with metrics.engine_call("sampler", "load_adapter") as timer:
                    await asyncio.to_thread(load_many, adapters)
        except Exception:  # not fatal: a sample loads its adapter on demand
            log.exception("publishing %d adapters failed", len(adapters))
            return
        metrics.adapter_published(timer.seconds)
        self._loaded.update(a for a, _ in adapters)

    @asynccontextmanager
    async def training_phase(self) -> AsyncIterator[None]:
        """Colocated mode: no sampling while the trainer runs; the sampler's memory is released
        before and taken back after (a no-op for engines without release/resume)."""
        if not self.colocate:
            yield
            return
        async with self._engine_lock:
            log.info("phase: train (sampler released)")
            await asyncio.to_thread(self.engine.release)
            metrics.sampler_memory("release")
            try:
                yield
            finally:
                await asyncio.to_thread(self.engine.resume)
                metrics.sampler_memory("resume")
                log.info("phase: sample (sampler resumed)")

    async def _ensure_adapter(self, adapter_id: str, directory: Path) -> None:
        if adapter_id in self._loaded:
            return
        async with self._engine_lock:
            with metrics.engine_call("sampler", "load_adapter") as timer:
                await asyncio.to_thread(self.engine.load_adapter, adapter_id, directory)
        metrics.adapter_published(timer.seconds)
        self._loaded.add(adapter_id)

    async def run(self) -> None:
        while not self._stopping:
            try:
                served = await self.serve_once()
            except EngineDied as exc:  # the batch stays queued and runs on a fresh sampler
                log.error("sampling engine died (%s); restarting it", exc)
                metrics.scheduler_error("engine")
                self._loaded.clear()
                restart = getattr(self.engine, "restart", None)
                if restart is None:
                    raise
                await asyncio.to_thread(restart)
                served = 0
            except Exception:
                log.exception("sampling batch failed")
                metrics.scheduler_error("sampling")
                served = 0
                await asyncio.sleep(0.5)
            if not served:
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                self.wake.clear()

    async def serve_once(self) -> int:
        request_ids = await self.store.queued_samples(self.max_batch)
        metrics.sample_backlog(len(request_ids) if len(request_ids) < self.max_batch
                               else await self.store.sample_backlog())
        if not request_ids:
            return 0
        jobs: list[Job] = []
        requests: list[SampleRequest] = []
        topk: list[int] = []
        for job in await self.store.jobs(request_ids):
            if job.status != "pending":
                await self.store.finish_job(job, result=job.result, error=job.error)
                continue
            try:
                sample = pb.SubmitRequest.FromString(job.payload).sample
                adapter_id = await self._adapter_for(sample.sampling_session_id)
            except LookupError as exc:
                await self._finish(job, error=str(exc))
                metrics.sample_failed([job.owner])
                continue
            jobs.append(job)
            requests.append(translate.sample_request(job.request_id, sample, adapter_id))
            topk.append(sample.topk_prompt_logprobs)
        if requests:
            async with self._engine_lock:
                with metrics.engine_call("sampler", "sample") as timer:
                    results = await asyncio.to_thread(self.engine.sample, requests)
            metrics.sampled([job.owner for job in jobs], results, timer.seconds)
            for job, result, k in zip(jobs, results, topk, strict=True):
                if result.error is not None:
                    await self._finish(job, error=result.error)
                else:
                    response = translate.sample_response(result, k)
                    await self._finish(job, result=pb.JobResult(sample=response))
        return len(request_ids)

    async def _adapter_for(self, sampler_id: str) -> str | None:
        sampler = await self.store.sampler(sampler_id)
        if sampler is None:
            raise LookupError(f"sampling_session_id: {sampler_id} does not exist")
        if sampler.adapter_dir is None or sampler.adapter_id is None:
            return None
        await self._ensure_adapter(sampler.adapter_id, Path(sampler.adapter_dir))
        return sampler.adapter_id

    async def _finish(
        self, job: Job, result: pb.JobResult | None = None, error: str | None = None
    ) -> None:
        await self.store.finish_job(
            job, result=result.SerializeToString() if result else None, error=error
        )
        self.board.notify(job.request_id)
