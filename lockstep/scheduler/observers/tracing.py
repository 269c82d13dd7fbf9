"""Session traces: a Chrome-trace / Perfetto timeline of every request a session made.

Why a step was slow: it waited for a cycle (queue wait), shared the cycle with others, or spent
its time in the pass, the optimizer step, the snapshot or a save; a sample waited for, or ran
in, a sampling batch. The clock (its `observers.TraceObserver`), the dispatcher, the sampling
lane and submissions call the small hooks below; everything else (timing, event layout, Redis)
lives here.

Layout (Chrome trace "X" events, wall-clock microseconds):
- one process per training run or sampling session, one thread per request:
  `request <kind>` > (`queue wait`, `cycle N` > engine phases)  /  (`queue wait`, `sampling batch`)
- the process "clock" with one thread, "cycles": each cycle the session took part in, with the
  tenants and tokens it packed and its phases.

Events are appended to a Redis list per session (`state/traces.py`) that expires
`retention_s` after its last write (0: tracing off), queued on the batch of the cycle's (or
sampling batch's) other writes (`state/batch.py`): no round trip of their own.
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypedDict

from lockstep.config.sections import TRACE_RETENTION_S
from lockstep.observability import metrics
from lockstep.observability.metrics import RedisCaller
from lockstep.scheduler.state.batch import WriteBatch
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.traces import TraceLog

log = logging.getLogger(__name__)


class Event(TypedDict):
    """A Chrome-trace event: complete ("X", a span) or metadata ("M", a name)."""

    name: str
    ph: str
    pid: int
    tid: int
    ts: int
    dur: int
    args: Mapping[str, object]


class StoredEvent(Event):
    """An event as stored: with its process's and thread's names (export makes them "M"s)."""

    process: str
    thread: str


Trace = dict[str, object]  # {"traceEvents": [...], "displayTimeUnit": "ms"}
Events = dict[str, list[StoredEvent]]  # per session

DEFAULT_RETENTION_S = TRACE_RETENTION_S
# The most events a session's trace keeps (the oldest go first; older than the retention go
# too): the last few thousand requests, a few MB.
MAX_EVENTS_PER_SESSION = 20_000
MAX_PENDING_SUBMISSIONS = 100_000  # submission times kept in memory until the request runs
CLOCK_PID = 0


def session_of(entity_id: str) -> str:
    """`<session>:train:<n>` or `<session>:sample:<n>` -> `<session>`."""
    for marker in (":train:", ":sample:"):
        if marker in entity_id:
            return entity_id.split(marker, 1)[0]
    return entity_id


def _pid(entity_id: str) -> int:
    return zlib.crc32(entity_id.encode()) % 1_000_000 + 1  # stable, never the clock's 0


def _us(t: float) -> int:
    return int(t * 1_000_000)


@dataclass
class Span:
    name: str
    start: float
    end: float


@dataclass
class CycleTrace:
    cycle: int
    ops: list[QueuedOp]
    tenants: int
    tokens: int
    planned: float  # when its planning began (every request queued before then was planned)
    start: float = field(default_factory=time.time)
    spans: dict[str, list[Span]] = field(default_factory=dict)  # request_id -> its phases
    phases: list[Span] = field(default_factory=list)  # the cycle's own phases
    _open: list[QueuedOp] = field(default_factory=list)  # ops of the phase running now


class Tracer:
    def __init__(self, log: TraceLog, retention_s: int = DEFAULT_RETENTION_S) -> None:
        self.log = log
        self.retention_s = retention_s
        self._submitted: dict[str, float] = {}

    # ------------------------------------------------------------------ recording
    def submitted(self, request_id: str) -> None:
        if not self.retention_s:
            return
        now = time.time()
        self._submitted.setdefault(request_id, now)
        if len(self._submitted) > MAX_PENDING_SUBMISSIONS:  # requests that never ran (refused)
            self._submitted = {r: t for r, t in self._submitted.items() if now - t < 3600}

    def _queued_since(self, request_id: str, start: float) -> float | None:
        t = self._submitted.pop(request_id, None)
        return None if t is None else min(t, start)  # the claim may land just before planning

    def cycle_done(self, trace: CycleTrace, batch: WriteBatch) -> None:
        end = time.time()
        per_session: Events = {}
        cycle_args = {
            "cycle": trace.cycle,
            "tenants": trace.tenants,
            "tokens": trace.tokens,
            "planned_us": _us(trace.planned),
        }
        for op in trace.ops:
            if op.kind == "rejected":
                continue
            events = per_session.setdefault(session_of(op.model_id), [])
            where = (_pid(op.model_id), op.seq_id + 1, op.model_id, f"{op.kind} #{op.seq_id}")
            queued = self._queued_since(op.request_id, trace.start)
            args = {"request_id": op.request_id, "seq_id": op.seq_id, **cycle_args}
            events.append(_x(f"request {op.kind}", queued or trace.start, end, where, args))
            if queued is not None:
                events.append(_x("queue wait", queued, trace.start, where))
            events.append(_x(f"cycle {trace.cycle}", trace.start, end, where, cycle_args))
            spans = trace.spans.get(op.request_id, [])
            events += [_x(s.name, s.start, s.end, where) for s in spans]
        clock = (CLOCK_PID, 1, "clock", "cycles")
        for events in per_session.values():
            events.append(_x(f"cycle {trace.cycle}", trace.start, end, clock, cycle_args))
            events += [_x(s.name, s.start, s.end, clock) for s in trace.phases]
        self._queue(batch, per_session)

    def sampled(
        self, writes: WriteBatch, requests: Iterable[tuple[str, str, int]], start: float
    ) -> None:
        """A sampling batch of (request_id, sampling session id, seq_id) ran from `start`."""
        end = time.time()
        batch = list(requests)
        per_session: Events = {}
        for request_id, sampler_id, seq_id in batch:
            where = (_pid(sampler_id), seq_id + 1, sampler_id, f"sample #{seq_id}")
            queued = self._queued_since(request_id, start)
            events = per_session.setdefault(session_of(sampler_id), [])
            args = {"request_id": request_id, "seq_id": seq_id, "batch_size": len(batch)}
            events.append(_x("request sample", queued or start, end, where, args))
            if queued is not None:
                events.append(_x("queue wait", queued, start, where))
            events.append(_x("sampling batch", start, end, where, {"batch_size": len(batch)}))
        self._queue(writes, per_session)

    def _queue(self, batch: WriteBatch, per_session: Events) -> None:
        """On the batch of the cycle's (or sampling batch's) other writes: one round trip. A
        trace is a diagnostic: a refused write is logged by the batch, never raised."""
        if not self.retention_s or not per_session:
            return
        encoded = {s: [json.dumps(e) for e in events] for s, events in per_session.items()}
        batch.trace(encoded, MAX_EVENTS_PER_SESSION, self.retention_s)

    # ------------------------------------------------------------------ export
    async def export(self, session_id: str) -> Trace:
        """The session's Chrome-trace JSON object (open it in ui.perfetto.dev)."""
        raw = await self.log.read(session_id)
        events: list[Event] = []
        names: dict[tuple[int, int | None], str] = {}
        for item in raw:
            e: StoredEvent = json.loads(item)
            names[(e["pid"], None)] = e["process"]
            names[(e["pid"], e["tid"])] = e["thread"]
            events.append(
                Event(
                    name=e["name"],
                    ph=e["ph"],
                    pid=e["pid"],
                    tid=e["tid"],
                    ts=e["ts"],
                    dur=e["dur"],
                    args=e["args"],
                )
            )
        meta: list[dict[str, object]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
            if tid is None
            else {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for (pid, tid), name in names.items()
        ]
        # Parents before children at equal start times, so viewers nest them.
        events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
        return {"traceEvents": [*meta, *events], "displayTimeUnit": "ms"}


def _x(
    name: str,
    start: float,
    end: float,
    where: tuple[int, int, str, str],
    args: Mapping[str, object] | None = None,
) -> StoredEvent:
    pid, tid, process, thread = where
    ts = _us(start)
    dur = max(_us(end) - ts, 0)
    return StoredEvent(
        name=name,
        ph="X",
        ts=ts,
        dur=dur,
        pid=pid,
        tid=tid,
        process=process,
        thread=thread,
        args=args or {},
    )


# ---------------------------------------------------------------------- hooks for dispatch
# The cycle being dispatched, so dispatch marks its phases without passing a tracer around.
_current: ContextVar[CycleTrace | None] = ContextVar("lockstep_cycle_trace", default=None)


def begin_cycle(
    cycle: int, ops: list[QueuedOp], tenants: int, tokens: int, planned: float
) -> CycleTrace:
    trace = CycleTrace(cycle, ops, tenants, tokens, planned)
    _current.set(trace)
    return trace


@contextmanager
def phase(name: str, ops: Iterable[QueuedOp]) -> Iterator[None]:
    """Time a dispatch phase for `ops` (and for the cycle's own track)."""
    trace = _current.get()
    if trace is None:
        yield
        return
    outer, trace._open = trace._open, list(ops)
    start = time.time()
    try:
        yield
    finally:
        span = Span(name, start, time.time())
        for op in trace._open:
            trace.spans.setdefault(op.request_id, []).append(span)
        if not outer:
            trace.phases.append(span)
        trace._open = outer


@contextmanager
def model_phase(name: str, model_id: str) -> Iterator[None]:
    """A step of the running phase that belongs to one model (its snapshot)."""
    trace = _current.get()
    ops = [op for op in trace._open if op.model_id == model_id] if trace else []
    with phase(name, ops):
        yield


# ---------------------------------------------------------------------- the process's tracer
_tracer: Tracer | None = None  # set by the scheduler at start-up; None: hooks do nothing


def configure(log: TraceLog, retention_s: int) -> Tracer:
    global _tracer
    _tracer = Tracer(log, retention_s)
    return _tracer


def submitted(request_id: str) -> None:
    if _tracer is not None:
        _tracer.submitted(request_id)


def cycle_done(trace: CycleTrace, batch: WriteBatch) -> None:
    _current.set(None)
    metrics.REDIS_CALLER.set(RedisCaller.CLOCK_AFTER)  # the futures are answered
    if _tracer is not None:
        _tracer.cycle_done(trace, batch)


def sampled(writes: WriteBatch, requests: Iterable[tuple[str, str, int]], start: float) -> None:
    if _tracer is not None:
        _tracer.sampled(writes, requests, start)


async def export(session_id: str) -> Trace:
    if _tracer is None:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    return await _tracer.export(session_id)
