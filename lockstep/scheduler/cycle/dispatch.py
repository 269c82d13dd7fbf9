"""Dispatch: execute one CyclePlan on the training engine.

Order inside a cycle: PRE ops (creations, loads, early saves) -> ONE fused pass over every
tenant's forward/forward_backward -> ONE batched optimizer step -> POST ops (saves). Each op
yields an Outcome; nothing is written to Redis here (that is `collect`). What an op does is its
own module's rule (`scheduler/ops/`): a single op runs itself (`SingleOp.run`, with this
Dispatcher as its RunContext); a pass or step op says how its share of the ONE engine call is
built and how its result is encoded, and the calls are batched here.

Durability is `recovery.py`'s (snapshots, restore and replay, the resident set): dispatch asks
it to make a cycle's models resident and to snapshot after a step. If the engine dies during a
cycle, the cycle is abandoned before anything is written and runs again on a fresh engine.

A request the planner runs in parts (`planner.Part`) is kept between its cycles (`parts.py`):
each cycle runs its part, the last joins the parts' results, and a failed part undoes the
earlier ones (`TrainingEngine.undo_parts`) so the request fails leaving no gradient behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from lockstep.engine.interface import EngineDied, TrainingEngine
from lockstep.engine.types import OptimRequest, PassPart, PassRequest, PassResult
from lockstep.scheduler.admission.decoded import DecodedPasses
from lockstep.scheduler.cycle.parts import RequestsInParts, datum_tokens
from lockstep.scheduler.cycle.poison import PoisonHunt
from lockstep.scheduler.cycle.recovery import Recovery, trainer_call
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.ops import registry
from lockstep.scheduler.planner import CyclePlan, Datums, Part
from lockstep.scheduler.state.outcome import Outcome, failure
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import ErrorCategory

log = logging.getLogger(__name__)
R = TypeVar("R")


class CycleAborted(RuntimeError):
    """The engine died mid-cycle: nothing of the cycle is recorded; it runs again."""


class Dispatcher:
    def __init__(
        self,
        store: Store,
        engine: TrainingEngine,
        recovery: Recovery,
        decoded: DecodedPasses | None = None,
    ) -> None:
        self.store = store
        self.images = recovery.images  # payloads' images, judged at submission
        # Passes validated and decoded at submission (run as they are); payloads of the rest,
        # read for the whole cycle in one round trip (`begin`).
        self.decoded = decoded or DecodedPasses()
        self._payloads: dict[str, bytes] = {}
        self.engine = engine
        self.recovery = recovery
        self.data_dir = recovery.data_dir
        # Which request kills the engine, when one does every time (bounded restarts).
        self.poison = PoisonHunt()
        # Passes the planner runs in parts: each whole request and its parts' results so far.
        self.parts = RequestsInParts()

    # The Dispatcher is the RunContext its ops run in (scheduler/ops/base.py): `call`,
    # `durable_snapshot`, `ensure_resident`, and the store, engine, data dir and residency.
    async def call(self, fn: Callable[..., R], *args: object) -> R:
        return await trainer_call(fn, *args)

    @property
    def resident(self) -> Residency:
        return self.recovery.resident

    async def durable_snapshot(self, model_id: str, seq: int) -> None:
        await self.recovery.durable_snapshot(model_id, seq)

    async def ensure_resident(self, model_id: str) -> None:
        await self.recovery.ensure_resident(model_id)

    async def begin(self, plan: CyclePlan) -> int:
        """Number the cycle and read the payloads it needs (not decoded already): one round
        trip, none when every payload is held."""
        ops = [*plan.pre, *plan.passes, *plan.optims, *plan.post]
        held = (self.decoded, self.parts)  # decoded at submission, or kept between parts
        unread = [op.request_id for op in ops if not any(op.request_id in h for h in held)]
        cycle, self._payloads = await self.store.cycles.begin(unread)
        return cycle

    async def datums(
        self, queues: dict[str, list[QueuedOp]], next_seq: dict[str, int], pace: int | None
    ) -> dict[str, Datums]:
        """What the planner may split: every request in parts and, while tenants share the clock
        (`pace`: the clock's pace, None when a model is alone), each model's first ready pass
        larger than the pace, with each datum's tokens (read from the pass held decoded, or
        decoded from its payload and then held for dispatch)."""
        queued = {op.request_id for ops in queues.values() for op in ops}
        self.parts.keep_only(queued, self.resident)
        out = self.parts.datums()
        if pace is None:
            return out
        for model_id, ops in queues.items():
            expected = next_seq.get(model_id, 0)
            for op in sorted(ops, key=lambda o: o.seq_id):
                if op.seq_id < expected:
                    continue
                if op.seq_id != expected or op.request_id in out:
                    break  # a gap, or a request in parts: it comes first
                expected += 1
                if registry.is_pass(op.kind) and op.tokens > pace:
                    held = await self._held_pass(op)
                    if held is not None:
                        out[op.request_id] = Datums(datum_tokens(held))
                    break
        return out

    async def _held_pass(self, op: QueuedOp) -> PassRequest | None:
        held = self.decoded.peek(op.request_id)
        if held is not None:
            return held
        try:
            decoded = await registry.fused_pass(op.kind).decode(
                self.store, self.images, op.request_id, await self._request(op)
            )
        except Exception:  # dispatch runs it whole and reports why it cannot
            return None
        self.decoded.keep(op.request_id, decoded)
        return decoded

    async def run(self, plan: CyclePlan, cycle: int) -> dict[str, Outcome]:
        """Execute the plan; one Outcome per op. A model whose state cannot be restored fails
        its own ops (with the reason) and the other tenants' work goes on."""
        try:
            await self.recovery.before_cycle([w.model_id for w in plan.models])
            outcomes: dict[str, Outcome] = {}
            for work in plan.models:
                broken = await self.recovery.restore(work.model_id)
                if broken is not None:
                    outcomes.update((op.request_id, broken) for op in work.runs())
                    self.parts.drop(op.request_id for op in work.runs())

            def runnable(ops: list[QueuedOp]) -> list[QueuedOp]:
                return [op for op in ops if op.request_id not in outcomes]

            for op in runnable(plan.pre):
                with tracing.phase(op.kind, [op]):  # [trace hook]
                    outcomes[op.request_id] = await self._single(op)
            with tracing.phase("pass", plan.passes):  # [trace hook]
                outcomes.update(await self._passes(runnable(plan.passes), cycle, plan.parts))
            with tracing.phase("optimizer step", plan.optims):  # [trace hook]
                outcomes.update(await self._optims(runnable(plan.optims)))
            for op in runnable(plan.post):
                with tracing.phase(op.kind, [op]):  # [trace hook]
                    outcomes[op.request_id] = await self._single(op)
            return outcomes
        except EngineDied as exc:
            log.error("training engine died during cycle %d (%s); restarting it", cycle, exc)
            self.resident.clear()  # the engine's memory is gone: it restores what it needs
            self.parts.clear()  # their earlier parts died with it: they start again
            await asyncio.to_thread(self.engine.restart)
            raise CycleAborted(str(exc)) from exc

    def forget(self, plan: CyclePlan) -> None:
        """The plan ran but its outcomes were not recorded: the engine is ahead of the recorded
        state for its models. Each is restored from that state before its next op (and its
        requests in parts start again: `parts.keep_only`), so its work runs once more, once."""
        for work in plan.models:
            self.resident.discard(work.model_id)

    async def _request(self, op: QueuedOp) -> pb.SubmitRequest:
        payload = self._payloads.pop(op.request_id, None)
        if payload is None:  # not read with its cycle (a re-run after an abort)
            job = await self.store.jobs.get(op.request_id)
            if job is None:
                raise RuntimeError(f"job {op.request_id} vanished from the store")
            payload = job.payload
        req = pb.SubmitRequest()
        req.ParseFromString(payload)
        return req

    async def _pass(self, op: QueuedOp, part: Part | None) -> PassRequest:
        """The pass as validated at submission, or decoded from its payload (its op's rule);
        of a request in parts, this cycle's part."""
        whole = None if part is not None and part.start else self.decoded.take(op.request_id)
        if whole is None and op.request_id not in self.parts:
            whole = await registry.fused_pass(op.kind).decode(
                self.store, self.images, op.request_id, await self._request(op)
            )
        if part is None:
            assert whole is not None
            return whole
        return self.parts.part(whole, op.request_id, part)

    async def _single(self, op: QueuedOp) -> Outcome:
        """An op that runs alone (create, load, save): its op runs it."""
        try:
            rules = registry.single(op.kind)
            return await rules.run(self, op, await self._request(op))
        except Exception as exc:
            log.warning("request %s (%s) failed: %s", op.request_id, op.kind, exc)
            return failure(exc, f"{op.kind} of {op.model_id}")

    async def _passes(
        self, passes: list[QueuedOp], cycle: int, parts: dict[str, Part]
    ) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        requests: list[PassRequest] = []
        for op in passes:
            refused = self.poison.verdict(op.request_id)
            if refused is not None:  # it killed the engine on its own: never run again
                outcomes[op.request_id] = Outcome(error=refused, category=ErrorCategory.USER)
                self.parts.drop([op.request_id])
                continue
            try:
                requests.append(await self._pass(op, parts.get(op.request_id)))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        results: list[PassResult] = []
        for call in self.poison.calls([r.request_id for r in requests], requests):
            results.extend(await self._run_passes(call, outcomes))
        for failed in (r for r in requests if r.request_id in outcomes):
            await self._undo_parts(failed)  # before anything else of its model runs
        queued = {op.request_id: op for op in passes}
        for res in results:  # each result encoded by its op
            op = queued[res.request_id]
            part = parts.get(res.request_id)
            whole = res if part is None else self.parts.ran(part, res)
            if whole is not None:  # None: a part before the last (no outcome yet)
                outcomes[res.request_id] = registry.fused_pass(op.kind).outcome(op, whole, cycle)
        return outcomes

    async def _run_passes(
        self, call: list[PassRequest], outcomes: dict[str, Outcome]
    ) -> list[PassResult]:
        """One run_passes call. A request the engine says failed alone (`PassResult.error`)
        fails with its error and the others keep their results. Only a failure the engine
        cannot attribute (the call raised: run_passes is then atomic, no gradient left behind)
        re-runs the call's requests one by one."""
        ids = [r.request_id for r in call]
        try:
            results = await self.call(self.engine.run_passes, call)
        except EngineDied as exc:  # the cycle is abandoned and runs again; keep score
            self.poison.died(ids, str(exc))
            raise
        except Exception as exc:
            if len(call) == 1:
                outcomes[call[0].request_id] = failure(exc)
                return []
            log.warning("fused pass failed (%s); retrying requests one by one", exc)
            return [res for r in call for res in await self._run_passes([r], outcomes)]
        self.poison.survived(ids)
        for res in results:
            if res.error is not None:
                outcomes[res.request_id] = Outcome(error=res.error, category=ErrorCategory.USER)
        return [res for res in results if res.error is None]

    async def _undo_parts(self, failed: PassRequest) -> None:
        """A part failed: its request fails, and the gradients of its earlier parts go (the
        part is its model's only request in the call, so nothing else of the model is lost)."""
        if failed.part is PassPart.WHOLE:
            return
        self.parts.drop([failed.request_id])
        await self.call(self.engine.undo_parts, failed.model_id)

    async def _optims(self, steps: list[QueuedOp]) -> dict[str, Outcome]:
        if not steps:
            return {}
        outcomes: dict[str, Outcome] = {}
        requests: dict[str, OptimRequest] = {}
        for op in steps:  # each op says its share of the ONE batched step
            try:
                rules = registry.step(op.kind)
                requests[op.request_id] = rules.request(op.model_id, await self._request(op))
            except Exception as exc:
                outcomes[op.request_id] = failure(exc)
        try:
            metrics = await self.call(self.engine.optim_step, list(requests.values()))
        except Exception as exc:
            return outcomes | {rid: failure(exc) for rid in requests}
        queued = {op.request_id: op for op in steps}
        for rid, r in requests.items():
            try:  # None: the step stays in the replay log until its snapshot is recorded
                snapshot_seq = await self.recovery.after_step(r.model_id, queued[rid].seq_id)
            except Exception as exc:  # not recorded: the engine rolls back to the recorded state
                log.warning("optim_step %s: snapshot failed: %s", rid, exc)
                outcomes[rid] = failure(exc, f"the optimizer step of {r.model_id}")
                continue
            step = registry.step(queued[rid].kind)
            outcomes[rid] = step.outcome(metrics.get(r.model_id, {}), snapshot_seq)
        return outcomes
