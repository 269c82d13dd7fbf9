"""Where the milliseconds of one minimal request go (control_plane.py's span profile).

Requests run one at a time. Around each, both processes' /metrics are scraped (outside the timed
window), so the difference of each counter is that request's own: the gateway's gRPC call
seconds per method, the scheduler's handler seconds per method, Redis round trips and their
seconds per caller, engine seconds. The SDK's HTTP calls are timed in this process (httpx's
`AsyncClient.send`), and the session trace (`--trace-retention`) gives each request's
submission, cycle (or sampling batch) start and end on the scheduler's clock (one host: one
wall clock).

The request's wall time is cut at those instants, end to end:

    SDK before send | way in (HTTP, gateway, gRPC, Submit) | queue wait | cycle / batch |
    way out (wake, read the result, gRPC, HTTP) | SDK after the reply

and each cut is split by the layer timings inside it; `Redis` is taken from where its caller
ran (rpc:Submit from the way in, clock_plan from the queue wait, the cycle's steps and the lane
from the cycle / batch, one rpc:RetrieveFuture round trip from the way out). clock_after (trace,
usage, durability after the futures are answered) is off the request's path and not counted.
The parts of one request sum to its wall time; the profile is the per-part median.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import usage

# Bar order, bottom to top; the engine's own compute is its in-process median time.
PARTS = (
    "SDK client",
    "HTTP + gateway",
    "gRPC hop",
    "scheduler handler",
    "Redis",
    "clock wait",
    "engine compute",
    "engine idle wake",
    "engine pipe",
    "cycle other",
    "future retrieval",
)
ENGINE_PHASES = {"trainer": "trainer,train", "sampler": "sampler,sample"}  # busy-seconds labels
SIDE = ("/api/v1/telemetry", "/api/v1/session_heartbeat")  # the SDK's own background calls


def scrape(url: str, families: tuple[str, ...]) -> dict[tuple[str, str], float]:
    """(metric, its label values joined by ",") -> value, for the named sample names."""
    out: dict[tuple[str, str], float] = {}
    for sample in usage.samples(url):
        if sample.name in families:
            key = (sample.name, ",".join(sample.labels.values()))
            out[key] = out.get(key, 0.0) + sample.value
    return out


GATEWAY_FAMILIES = ("lockstep_grpc_client_duration_seconds_sum",)
SCHEDULER_FAMILIES = (
    "lockstep_rpc_duration_seconds_sum",
    "lockstep_redis_round_trips_total",
    "lockstep_redis_round_trip_seconds_total",
    "lockstep_engine_busy_seconds_total",
)


def delta(
    after: dict[tuple[str, str], float], before: dict[tuple[str, str], float]
) -> dict[tuple[str, str], float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


class HttpLog:
    """Every HTTP call this process's httpx clients send: (path, start, end), wall clock."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()
        original = httpx.AsyncClient.send
        log = self

        async def send(client: httpx.AsyncClient, request: httpx.Request, **kw: Any) -> Any:
            start = time.time()
            response = await original(client, request, **kw)
            with log._lock:
                log.calls.append((request.url.path, start, time.time()))
            return response

        httpx.AsyncClient.send = send  # type: ignore[method-assign,assignment]

    def between(self, t0: float, t1: float) -> list[tuple[str, float, float]]:
        """The request's own calls (not the SDK's telemetry or heartbeats), by start time."""
        with self._lock:
            calls = [c for c in self.calls if c[1] >= t0 and c[2] <= t1 and c[0] not in SIDE]
        return sorted(calls, key=lambda c: c[1])


@dataclass
class Sample:
    """One request: client timings, metric differences, its trace instants."""

    t0: float
    t1: float
    http: list[tuple[str, float, float]]
    gateway: dict[tuple[str, str], float]
    scheduler: dict[tuple[str, str], float]
    trace: dict[str, float] = field(default_factory=dict)  # queued, start, end (seconds)


def record(
    call: Callable[[], object], n: int, log: HttpLog, gateway_url: str, scheduler_url: str
) -> list[Sample]:
    out = []
    for _ in range(n):
        g0, s0 = scrape(gateway_url, GATEWAY_FAMILIES), scrape(scheduler_url, SCHEDULER_FAMILIES)
        t0 = time.time()
        call()
        t1 = time.time()
        time.sleep(0.02)  # the cycle's bookkeeping after the reply (off the path) lands here
        g1, s1 = scrape(gateway_url, GATEWAY_FAMILIES), scrape(scheduler_url, SCHEDULER_FAMILIES)
        out.append(Sample(t0, t1, log.between(t0, t1), delta(g1, g0), delta(s1, s0)))
    return out


def attach_trace(samples: list[Sample], trace: dict[str, Any], kind: str) -> None:
    """Each sample's `request <kind>` event of the session trace, and its cycle / batch start."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    requests = [e for e in events if e["name"] == f"request {kind}"]
    for s in samples:
        for r in requests:
            queued, end = r["ts"] / 1e6, (r["ts"] + r["dur"]) / 1e6
            if s.t0 <= queued and end <= s.t1 + 0.001:
                children = [
                    e
                    for e in by_thread[(r["pid"], r["tid"])]
                    if e["name"] == "queue wait" and abs(e["ts"] - r["ts"]) < 2
                ]
                start = (children[0]["ts"] + children[0]["dur"]) / 1e6 if children else queued
                s.trace = {"queued": queued, "start": start, "end": end}
                break


def parts(  # noqa: C901
    s: Sample, engine: str, in_process_s: float, paced_s: float
) -> dict[str, float] | None:
    """One request's wall time cut into PARTS (seconds); None without its trace event.
    `in_process_s`: the engine call's in-process median, called back to back; `paced_s`: the
    same with the engine idle between calls as the server's is (the difference, an idle core's
    cold caches and wake-up, is the machine's, not the pipe's)."""
    if not s.trace or len(s.http) < 2:
        return None
    g, sch, tr = s.gateway, s.scheduler, s.trace
    grpc = {k[1]: v for k, v in g.items()}
    rpc = {k[1]: v for k, v in sch.items() if k[0] == "lockstep_rpc_duration_seconds_sum"}
    trips = {k[1]: v for k, v in sch.items() if k[0] == "lockstep_redis_round_trips_total"}
    redis_s = {k[1]: v for k, v in sch.items() if k[0] == "lockstep_redis_round_trip_seconds_total"}
    busy = sch.get(("lockstep_engine_busy_seconds_total", ENGINE_PHASES[engine]), 0.0)
    (_, a1, _), (_, a_last, b_last) = s.http[0], s.http[-1]
    retrieve = [m for m in rpc if m.startswith("Retrieve")]  # the long polls of the future
    # the way in: SDK -> gateway -> Submit, up to the submission's trace instant
    way_in = tr["queued"] - a1
    grpc_in = max(grpc.get("Submit", 0.0) - rpc.get("Submit", 0.0), 0.0) / 2
    redis_in = min(redis_s.get("rpc:Submit", 0.0), rpc.get("Submit", 0.0))
    handler_in = rpc.get("Submit", 0.0) - redis_in
    # the way out: the cycle's end -> the future's reply in the SDK
    way_out = b_last - tr["end"]
    g_out = sum(grpc.get(m, 0.0) for m in retrieve)
    r_out = sum(rpc.get(m, 0.0) for m in retrieve)
    grpc_out = max(g_out - r_out, 0.0) / 2
    http_out = max((b_last - a_last) - g_out, 0.0) / 2
    calls = sum(trips.get(f"rpc:{m}", 0.0) for m in retrieve)
    redis_out = sum(redis_s.get(f"rpc:{m}", 0.0) for m in retrieve) / calls if calls else 0.0
    redis_out = min(redis_out, max(way_out - grpc_out - http_out, 0.0))
    # queue wait and the cycle / batch: the lane's Redis splits by their non-engine time
    queue, run = tr["start"] - tr["queued"], tr["end"] - tr["start"]
    if engine == "trainer":
        redis_queue = redis_s.get("clock_plan", 0.0)
        redis_run = redis_s.get("clock_dispatch", 0.0) + redis_s.get("clock_collect", 0.0)
    else:
        lane = redis_s.get("sampling", 0.0)
        share = queue / max(queue + run - busy, 1e-9)
        redis_queue, redis_run = lane * share, lane * (1 - share)
    # Round trips of concurrent tasks overlap: a part's Redis is at most the part's own time.
    redis_queue = min(redis_queue, max(queue, 0.0))
    redis_run = min(redis_run, max(run - busy, 0.0))
    compute = min(in_process_s, busy)
    wake = min(max(paced_s - in_process_s, 0.0), busy - compute)
    out = {
        "SDK client": (a1 - s.t0) + (s.t1 - b_last),
        "HTTP + gateway": (way_in - grpc_in - rpc.get("Submit", 0.0)) + http_out,
        "gRPC hop": grpc_in + grpc_out,
        "scheduler handler": handler_in,
        "Redis": redis_in + redis_queue + redis_run + redis_out,
        "clock wait": queue - redis_queue,
        "engine compute": compute,
        "engine idle wake": wake,
        "engine pipe": busy - compute - wake,
        "cycle other": run - busy - redis_run,
        "future retrieval": way_out - grpc_out - http_out - redis_out,
    }
    return out


def profile(
    samples: list[Sample], engine: str, in_process_s: float, paced_s: float
) -> dict[str, Any]:
    """Per-part medians (ms) over the requests whose trace event was found."""
    cut = [p for p in (parts(s, engine, in_process_s, paced_s) for s in samples) if p is not None]
    if not cut:
        return {"requests": 0}
    walls = [s.t1 - s.t0 for s in samples if s.trace]

    def by_caller(family: str, scale: float) -> dict[str, float]:
        callers: dict[str, list[float]] = {}
        for s in samples:
            for (name, caller), v in s.scheduler.items():
                if name == family:
                    callers.setdefault(caller, []).append(v * scale)
        return {
            c: statistics.median(v + [0.0] * (len(samples) - len(v)))
            for c, v in sorted(callers.items())
        }

    return {
        "requests": len(cut),
        "wall_ms": statistics.median(walls) * 1000,
        "parts_ms": {k: statistics.median(p[k] for p in cut) * 1000 for k in PARTS},
        "redis_round_trips_by_caller": by_caller("lockstep_redis_round_trips_total", 1),
        "redis_ms_by_caller": by_caller("lockstep_redis_round_trip_seconds_total", 1000),
    }


def export_trace(base_url: str, api_key: str, session_id: str) -> dict[str, Any]:
    with httpx.Client(base_url=base_url, headers={"X-API-Key": api_key}, timeout=30) as http:
        url = http.get(f"/api/v1/sessions/{session_id}/trace_export").json()["url"]
        trace: dict[str, Any] = json.loads(http.get(url).content)
        return trace
