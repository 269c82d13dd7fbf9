"""The sampling lane: serves asample requests on the sampling engine, beside the clock.

Samples have no ordering constraints, so they do not wait for a training cycle: whatever is queued
is taken as one batch (every tenant's adapter mixed in it) and handed to the sampling engine.

Generations run in slices (`SamplingEngine.sample_slice`, `--sample-slice-steps` decode steps a
call): each call starts what was queued since the last one and moves every running generation
on, and the samples that finished are answered at once. So a 16-token sample queued beside a
4096-token generation waits at most one slice for its start, not for the whole generation; an
engine that does not slice runs each batch whole, as before.

Inflight clients (SDK kind="inflight") follow their training model's shared weights target
(`InflightTarget` in Redis, versioned by the save's seq_id). The lane serves each model's inflight
clients from ONE engine adapter, the newest version it has loaded (`_serving`), which only moves
forward. A client created at version v never runs on an older one: if the loaded version is older
than v its batch waits for the load. An older client whose target moved on keeps running on the
loaded version until the new one is loaded (started by the clock's publish, or by the first
sample that sees it), and switches at the next batch after that: within one publish. A superseded
version is unloaded at the start of the next batch, when no request can still name it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import NamedTuple

from lockstep.engine.images import RUN_AGAIN, ImageReader
from lockstep.engine.interface import EngineDied, SamplingEngine
from lockstep.engine.types import SampleRequest, SampleResult
from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.scheduler import translate
from lockstep.scheduler.admission.decoded import DecodedSamples
from lockstep.scheduler.cycle.poison import PoisonHunt
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.observers.accounting import Accounting
from lockstep.scheduler.state import sample_futures
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.jobs import Job
from lockstep.scheduler.state.records import InflightTarget, SamplerRecord
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import JobStatus

log = logging.getLogger(__name__)
DEFAULT_SLICE_STEPS = 8


class _Running(NamedTuple):
    """A sample the engine is generating (started by an earlier call, not answered yet)."""

    job: Job
    request: SampleRequest
    topk: int
    started: float  # time.time() of the call that started it [trace hook]


class SamplingLane:
    def __init__(
        self,
        store: Store,
        engine: SamplingEngine,
        board: FutureBoard,
        max_batch: int = 64,
        colocate: bool = False,
        slice_steps: int = DEFAULT_SLICE_STEPS,
    ) -> None:
        self.store = store
        self.colocate = colocate  # sampler and trainer share one accelerator
        self.engine = engine
        # Samples validated and decoded at submission (run as they are); the rest (a restarted
        # scheduler's, or what did not fit) are decoded from their payload, their images judged
        # at submission: the lane reads their headers only.
        self.decoded = DecodedSamples()
        self.images = ImageReader(engine.card().vision, RUN_AGAIN, decode=False)
        self.board = board
        self.max_batch = max_batch
        self.slice_steps = slice_steps  # decode steps per engine call
        self._running: dict[str, _Running] = {}  # request id -> a sample being generated
        self.wake = asyncio.Event()
        self._stopping = False
        self._loaded: set[str] = set()
        self._engine_lock = asyncio.Lock()
        self.accounting: Accounting | None = None  # tenancy: set by the scheduler server
        self._serving: dict[str, InflightTarget] = {}  # model -> newest loaded inflight version
        self._loading: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._retired: set[str] = set()  # superseded inflight adapters, unloaded before a batch
        # Which sample kills the sampling engine, when one does every time (bounded restarts).
        self.poison = PoisonHunt(
            "sample", "sampling engine", "a shorter prompt or fewer tokens may fit"
        )

    def stop(self) -> None:
        self._stopping = True
        self.wake.set()

    def publish(
        self, adapters: Sequence[tuple[str, Path]], targets: Sequence[InflightTarget] = ()
    ) -> None:
        """Publish every adapter one cycle changed, in one engine call, off the clock's path;
        then load the models' new inflight targets (each becomes the served version once in)."""
        fresh = [(a, d) for a, d in adapters if a not in self._loaded]
        if fresh:
            asyncio.get_running_loop().create_task(self._publish_all(fresh))
        for target in targets:
            self._start_target(target)

    # ---------------------------------------------------------------- inflight targets
    def _start_target(self, target: InflightTarget) -> asyncio.Task[None] | None:
        """Load `target` in the background unless that version or a newer one is served."""
        serving = self._serving.get(target.model_id)
        if serving is not None and serving.version >= target.version:
            return None
        key = (target.model_id, target.version)
        task = self._loading.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_target(target))
            self._loading[key] = task
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return task

    async def _load_target(self, target: InflightTarget) -> None:
        try:
            await self._ensure_adapter(target.adapter_id, Path(target.adapter_dir))
        except Exception:  # a waiting client's sample fails; the next publish tries again
            log.exception("loading inflight %s v%d failed", target.model_id, target.version)
            return
        serving = self._serving.get(target.model_id)
        if serving is not None and serving.version >= target.version:
            self._retired.add(target.adapter_id)  # a newer one got in first
            return
        if serving is not None:
            self._retired.add(serving.adapter_id)
        self._serving[target.model_id] = target
        log.info("inflight %s: serving version %d", target.model_id, target.version)

    async def _inflight_adapter(self, sampler: SamplerRecord) -> str:
        """The adapter an inflight client's sample runs on: the served version of its model,
        never older than the client (`min_version`)."""
        model_id = sampler.inflight_model
        assert model_id is not None and sampler.adapter_id and sampler.adapter_dir
        own = InflightTarget(model_id, sampler.min_version, sampler.adapter_id, sampler.adapter_dir)
        target = await self.store.checkpoints.inflight(model_id)
        if target is None or target.version < own.version:
            target = own
        task = self._start_target(target)  # no-op when the target is already served
        serving = self._serving.get(model_id)
        if task is not None and (serving is None or serving.version < sampler.min_version):
            await asyncio.shield(task)  # too old for this client: wait for the load
            serving = self._serving.get(model_id)
        if serving is None or serving.version < sampler.min_version:
            raise RuntimeError(f"inflight weights of {model_id} failed to load")
        return serving.adapter_id

    async def _unload_retired(self) -> None:
        """Free superseded inflight versions; called between engine calls, once no running
        generation uses them."""
        busy = {r.request.adapter_id for r in self._running.values()}
        for adapter_id in list(self._retired):
            if adapter_id in busy:
                continue  # a later call frees it
            self._retired.discard(adapter_id)
            if any(t.adapter_id == adapter_id for t in self._serving.values()):
                continue
            async with self._engine_lock:
                await asyncio.to_thread(self.engine.unload_adapter, adapter_id)
            self._loaded.discard(adapter_id)

    async def _publish_all(self, adapters: list[tuple[str, Path]]) -> None:
        try:
            async with self._engine_lock:
                with metrics.engine_call("sampler", "load_adapter") as timer:
                    await asyncio.to_thread(self.engine.load_adapters, adapters)
        except Exception:  # not fatal: a sample loads its adapter on demand
            log.exception("publishing %d adapters failed", len(adapters))
            return
        for _ in adapters:  # each adapter's time until the sampler holds it: the batch's
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

    async def unload(self, adapter_ids: list[str]) -> None:
        """Tenancy: a session ended; its adapters leave the sampler (a later sample that needs
        one, e.g. through a published checkpoint, loads it again)."""
        for adapter_id in adapter_ids:
            if adapter_id not in self._loaded:
                continue
            async with self._engine_lock:
                await asyncio.to_thread(self.engine.unload_adapter, adapter_id)
            self._loaded.discard(adapter_id)

    async def run(self) -> None:
        while not self._stopping:
            try:
                served = await self.serve_once()
            except EngineDied as exc:
                # The samples not yet answered stay queued and run on a fresh sampler, cut by
                # `poison` once a batch died twice, so one that kills it every time is refused.
                log.error("sampling engine died (%s); restarting it", exc)
                metrics.scheduler_error("engine")
                self._loaded.clear()
                self._serving.clear()  # a fresh engine has no adapters: reload on demand
                self._retired.clear()
                self._running.clear()  # they died with it; still queued, they run again
                await asyncio.to_thread(self.engine.restart)
                served = self.max_batch  # work is still queued: no waiting for a wake-up
            except Exception:
                log.exception("sampling batch failed")
                metrics.scheduler_error("sampling")
                self._running.clear()  # the engine dropped them; still queued, they run again
                served = 0
                await asyncio.sleep(0.5)
            if self._running:  # generations go on at once, taking in what was queued since
                continue
            if served < self.max_batch:  # the queue was drained: a new sample wakes the lane
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                self.wake.clear()

    async def serve_once(self) -> int:
        await self._unload_retired()
        cancels = self.board.cancels  # before the read: a cancel after it is counted below
        backlog, read, samplers = await self.store.cycles.sample_batch(
            self.max_batch + len(self._running)  # the running ones are still queued
        )
        metrics.sample_backlog(backlog)
        read = [job for job in read if job.request_id not in self._running]
        if not read:
            if self._running:
                await self._sample([])  # move the running generations on
            return 0
        jobs: list[Job] = []
        requests: list[SampleRequest] = []
        refused: list[tuple[Job, str]] = []
        for job in read:
            if job.status != JobStatus.PENDING:  # finished, or cancelled: only dequeue it
                await sample_futures.finish(self.store, job)
                continue
            verdict = self.poison.verdict(job.request_id)
            if verdict is not None:  # it killed the sampler on its own: never run again
                refused.append((job, verdict))
                continue
            try:
                request = self._request(job)
                session = request.cache_namespace or ""  # its sampling session
                request.adapter_id = await self._adapter_for(session, samplers.get(session))
            except (LookupError, RuntimeError, UserInputError) as exc:
                refused.append((job, str(exc)))
                continue
            jobs.append(job)
            requests.append(request)
        if refused:
            await self._finish_all([(job, None, error) for job, error in refused])
            metrics.sample_failed([job.owner for job, _ in refused])
        batch = [(j, r, r.topk_prompt_logprobs) for j, r in zip(jobs, requests, strict=True)]
        calls = self.poison.calls([r.request_id for r in requests], batch)
        for call in calls or [[]]:
            await self._sample(call, cancels)
        return len(read)

    async def _sample(
        self, call: list[tuple[Job, SampleRequest, int]], cancels: int | None = None
    ) -> None:
        """One engine call: it starts `call`'s samples and moves the running ones on. What
        finished is answered before the next call runs, so a later call that kills the engine
        leaves only unanswered samples queued. `cancels`: the board's count when the batch was
        read; statuses are read again only if a cancel came in since."""
        if cancels != self.board.cancels:
            call = await self._live(call)
        if not call and not self._running:
            return
        started = time.time()  # [trace hook]
        self._running.update(
            (request.request_id, _Running(job, request, k, started)) for job, request, k in call
        )
        requests = [request for _, request, _ in call]
        ids = list(self._running)  # every generation in the engine during this call
        try:
            async with self._engine_lock:
                with metrics.engine_call("sampler", "sample") as timer:
                    results = await asyncio.to_thread(
                        self.engine.sample_slice, requests, self.slice_steps
                    )
        except EngineDied as exc:
            self.poison.died(ids, str(exc))
            raise
        done = [(self._running.pop(result.request_id), result) for result in results]
        self.poison.survived([result.request_id for result in results])
        if done:
            await self._answer(done, timer.seconds)

    async def _answer(self, done: list[tuple[_Running, SampleResult]], seconds: float) -> None:
        """Answer these samples, with their usage and trace, in one round trip; wake their
        futures."""
        jobs = [run.job for run, _ in done]
        results = [result for _, result in done]
        metrics.sampled([job.owner for job in jobs], results, seconds)
        answers = [
            (run.job, None, result.error)
            if result.error is not None
            else (run.job, pb.JobResult(sample=translate.sample_response(result, run.topk)), None)
            for run, result in done
        ]
        encoded = _encoded(answers)
        logged: dict[str, list[sample_futures.Logged]] = {}
        try:
            async with self.store.batch() as batch:
                if self.accounting is not None:  # tenancy: usage per key
                    requests = [run.request for run, _ in done]
                    await self.accounting.on_sampled(jobs, requests, results, batch)
                at = sample_futures.queue_finish(batch, self.store.result_ttl_s, encoded)
                for started in sorted({run.started for run, _ in done}):  # [trace hook]
                    jobs_done = [
                        (r.job.request_id, r.job.model_id, r.job.seq_id)
                        for r, _ in done
                        if r.started == started
                    ]
                    tracing.sampled(batch, jobs_done, started)  # [trace hook]
            logged = sample_futures.logged(batch.replies, at, encoded)
        finally:  # a refused write still sent the answers beside it
            self._notify(jobs, logged)

    async def _live(
        self, call: list[tuple[Job, SampleRequest, int]]
    ) -> list[tuple[Job, SampleRequest, int]]:
        """The call without the samples cancelled since the batch was read (an adapter load or
        an earlier call of the batch can take a while): a cancelled sample never reaches the
        engine."""
        live = await sample_futures.pending(self.store, [job.request_id for job, _, _ in call])
        return [item for item in call if item[0].request_id in live]

    def _request(self, job: Job) -> SampleRequest:
        """The sample as validated at submission, or decoded from its payload."""
        held = self.decoded.take(job.request_id)
        if held is not None:
            return held
        sample = pb.SubmitRequest.FromString(job.payload).sample
        return translate.sample_request(job.request_id, sample, None, self.images)

    async def _adapter_for(self, sampler_id: str, sampler: SamplerRecord | None) -> str | None:
        if sampler is None:
            raise LookupError(f"sampling_session_id: {sampler_id} does not exist")
        if sampler.inflight_model is not None:
            return await self._inflight_adapter(sampler)
        if sampler.adapter_dir is None or sampler.adapter_id is None:
            return None
        await self._ensure_adapter(sampler.adapter_id, Path(sampler.adapter_dir))
        return sampler.adapter_id

    async def _finish_all(self, done: list[tuple[Job, pb.JobResult | None, str | None]]) -> None:
        """Answer these samples (one round trip) and wake their futures."""
        await sample_futures.finish_all(self.store, _encoded(done))
        self._notify([job for job, _, _ in done])

    def _notify(
        self, jobs: list[Job], logged: dict[str, list[sample_futures.Logged]] | None = None
    ) -> None:
        """Wake these samples' futures and their sessions' pollers, handing over what was
        logged (`logged`, per poller topic) so they need not read it back."""
        logged = logged or {}
        handed = {item.entry.request_id: item for items in logged.values() for item in items}
        for job in jobs:
            item = handed.get(job.request_id)
            self.board.notify(job.request_id, value=None if item is None else item.recorded())
        for topic in {sample_futures.job_topic(job) for job in jobs}:
            self.board.notify(topic, value=tuple(logged.get(topic, ())) or None)


def _encoded(
    done: Sequence[tuple[Job, pb.JobResult | None, str | None]],
) -> list[tuple[Job, bytes | None, str | None]]:
    return [
        (job, result.SerializeToString() if result else None, error) for job, result, error in done
    ]
