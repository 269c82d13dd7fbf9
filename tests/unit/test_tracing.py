"""The trace recorder on a real Redis: phases nest inside their cycle, the cycle's own track,
the retention TTL, and tracing off (retention 0) writes nothing."""

from __future__ import annotations

import asyncio
import time

from lockstep.scheduler.observers import tracing
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.store import Store

FB = QueuedOp("req-a", "sess-1:train:0", 1, "forward_backward", 40)
OPT = QueuedOp("req-b", "sess-1:train:0", 2, "optim_step", 0)
OTHER = QueuedOp("req-c", "sess-2:train:0", 1, "forward_backward", 8)


async def _cycle(store: Store) -> None:
    for op in (FB, OPT, OTHER):
        tracing.submitted(op.request_id)
    planned = time.time()
    await asyncio.sleep(0.01)
    trace = tracing.begin_cycle(7, [FB, OPT, OTHER], tenants=2, tokens=48, planned=planned)
    with tracing.phase("pass", [FB, OTHER]):
        await asyncio.sleep(0.01)
    with tracing.phase("optimizer step", [OPT]):
        with tracing.model_phase("snapshot", OPT.model_id):
            await asyncio.sleep(0.01)
    async with store.batch() as batch:  # the clock's batch of the cycle's writes
        tracing.cycle_done(trace, batch)


def test_a_cycle_is_recorded_per_session_and_nests(clean_redis: str) -> None:
    async def go() -> tuple[dict, dict, int]:  # type: ignore[type-arg]
        store = Store.from_url(clean_redis)
        tracing.configure(store.traces, retention_s=600)
        try:
            await _cycle(store)
            mine = await tracing.export("sess-1")
            other = await tracing.export("sess-2")
            ttl = await store.redis.ttl(keys.session_trace("sess-1"))
            return mine, other, ttl
        finally:
            tracing._tracer = None
            await store.close()

    mine, other, ttl = asyncio.run(go())
    assert 0 < ttl <= 600
    slices = [e for e in mine["traceEvents"] if e["ph"] == "X"]
    by_name: dict[str, list[dict]] = {}  # type: ignore[type-arg]
    for e in slices:
        by_name.setdefault(e["name"], []).append(e)
    assert len(by_name["request forward_backward"]) == 1  # sess-2's request is not here
    assert len(by_name["request optim_step"]) == 1
    assert len(by_name["queue wait"]) == 2
    clock = [e for e in slices if e["pid"] == tracing.CLOCK_PID]
    assert {e["name"] for e in clock} == {"cycle 7", "pass", "optimizer step"}
    planned_us = clock[0]["args"].pop("planned_us")
    assert clock[0]["args"] == {"cycle": 7, "tenants": 2, "tokens": 48}
    assert planned_us <= clock[0]["ts"]  # planned before it was dispatched
    # the snapshot is the optimizer step's child, on the optim_step request's row only
    (snap,) = by_name["snapshot"]
    (opt_phase,) = [e for e in by_name["optimizer step"] if e["pid"] != tracing.CLOCK_PID]
    assert snap["tid"] == opt_phase["tid"] == OPT.seq_id + 1
    assert (
        opt_phase["ts"] <= snap["ts"]
        and snap["ts"] + snap["dur"] <= opt_phase["ts"] + opt_phase["dur"]
    )
    for request in by_name["request forward_backward"] + by_name["request optim_step"]:
        inside = [e for e in slices if (e["pid"], e["tid"]) == (request["pid"], request["tid"])]
        for e in inside:
            assert request["ts"] <= e["ts"] and e["ts"] + e["dur"] <= request["ts"] + request["dur"]
    names = {(e["name"], e["args"]["name"]) for e in mine["traceEvents"] if e["ph"] == "M"}
    assert ("process_name", "sess-1:train:0") in names and ("thread_name", "cycles") in names
    theirs = {e["name"] for e in other["traceEvents"] if e["ph"] == "X" and e["pid"]}
    assert theirs == {"request forward_backward", "queue wait", "cycle 7", "pass"}


def test_retention_zero_records_nothing(clean_redis: str) -> None:
    async def go() -> dict:  # type: ignore[type-arg]
        store = Store.from_url(clean_redis)
        tracing.configure(store.traces, retention_s=0)
        try:
            await _cycle(store)
            return await tracing.export("sess-1")
        finally:
            tracing._tracer = None
            await store.close()

    assert asyncio.run(go())["traceEvents"] == []
