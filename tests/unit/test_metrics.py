"""The metrics module: bounded labels, busy time, the clock's and the gateway's reports, the
scheduler's ops server, and the dashboard / alert rules against the declared metrics."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from lockstep.observability import gateway_metrics, metrics
from lockstep.observability.ops_server import OpsServer
from lockstep.observability.tracking import OTHER, BusyWindow, OwnerCache, TenantLabels
from lockstep.scheduler.cycle.dispatch import Outcome
from lockstep.scheduler.observers.span import ClockMeter
from lockstep.scheduler.planner import CyclePlan, ModelWork
from lockstep.scheduler.state import redis_conn
from lockstep.scheduler.state.records import QueuedOp
from tests.promql import (
    alert_rules,
    dashboard,
    dashboard_queries,
    exported_names,
    promql_metric_names,
)
from tests.scheduler_standin import gateway_client, running_standin


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def value(name: str, registry: CollectorRegistry = metrics.SCHEDULER, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# ---------------------------------------------------------------- trackers
def test_tenant_labels_are_capped_and_idle_slots_are_reused() -> None:
    clock = FakeClock()
    labels = TenantLabels(cap=2, idle_s=60, now=clock)
    registry = CollectorRegistry()
    counter = Counter("t_total", "t", ["owner"], registry=registry)
    for owner in ("a", "b"):
        label = labels.label(owner)
        counter.labels(label).inc()
        labels.track(label, counter, (label,))
    assert labels.label("c") == OTHER  # both slots taken, nobody idle long enough
    assert labels.label(None) == OTHER and labels.label("other") == OTHER
    clock.now += 30
    assert labels.label("b") == "b"  # b stays active
    clock.now += 45  # a idle 75 s, b 45 s
    assert labels.label("c") == "c"  # takes a's slot; a's series go
    assert registry.get_sample_value("t_total", {"owner": "a"}) is None
    assert registry.get_sample_value("t_total", {"owner": "b"}) == 1
    assert labels.owners() == ["b", "c"]
    assert labels.label("a") == OTHER


def test_busy_window_counts_running_and_finished_intervals() -> None:
    clock = FakeClock()
    window = BusyWindow(window_s=10, now=clock)
    clock.now += 10
    assert window.end() == 0.0  # nothing running
    window.begin(clock.now - 4)
    assert window.end(clock.now - 2) == 2.0  # busy 2 of the last 10 s
    assert window.ratio() == pytest.approx(0.2)
    window.begin(clock.now - 1)  # a cycle still running for 1 s
    assert window.ratio() == pytest.approx(0.3)
    window.end()
    clock.now += 9.5  # only the last 0.5 s of the second interval is still in the window
    assert window.ratio() == pytest.approx(0.05)
    clock.now += 100
    assert window.ratio() == 0.0


def test_busy_window_young_process_uses_its_age() -> None:
    clock = FakeClock()
    window = BusyWindow(window_s=60, now=clock)
    window.begin(clock.now)
    clock.now += 2
    assert window.ratio() == 1.0


def test_owner_cache_resolves_each_model_once() -> None:
    class Record:
        def __init__(self, owner: str) -> None:
            self.owner = owner

    calls: list[str] = []

    async def lookup(model_id: str) -> Record | None:
        calls.append(model_id)
        return Record("o-" + model_id) if model_id != "gone" else None

    cache = OwnerCache(size=2)
    cache.note("m1", "known")
    asyncio.run(cache.resolve(["m1", "m2", "gone"], lookup))
    asyncio.run(cache.resolve(["m2"], lookup))
    assert calls == ["m2", "gone"]
    assert cache.get("m2") == "o-m2" and cache.get("gone") is None
    cache.note("m3", "x")  # size 2: the least recently used goes
    assert cache.get("m1") is None


# ---------------------------------------------------------------- the clock's report
def _op(rid: str, model: str, seq: int, kind: str, tokens: int = 0) -> QueuedOp:
    return QueuedOp(rid, model, seq, kind, tokens)


def test_clock_meter_reports_a_cycle() -> None:
    metrics.OWNERS.note("model-a", "owner-a")
    metrics.OWNERS.note("model-b", "owner-b")
    a = ModelWork(
        "model-a",
        passes=[_op("r1", "model-a", 1, "forward_backward", 100)],
        optim=_op("r2", "model-a", 2, "optim_step"),
    )
    b = ModelWork(
        "model-b",
        passes=[_op("r3", "model-b", 1, "forward", 300)],
        rejected=[_op("r4", "model-b", 2, "rejected")],
    )
    plan = CyclePlan(models=(a, b), budget=1000, deficits={"model-c": 10})
    queues = {"model-a": a.ops(), "model-b": b.ops()}
    outcomes = {"r1": Outcome(), "r2": Outcome(), "r3": Outcome(error="bad", category="user")}
    before = {
        n: value(n) for n in ("lockstep_cycle_tokens_total", "lockstep_cycle_token_budget_total")
    }
    work_before = value("lockstep_cycles_total", kind="work")
    ok_before = value(
        "lockstep_tenant_requests_total", owner="owner-a", kind="forward_backward", outcome="ok"
    )
    user_errors = value("lockstep_errors_total", component="scheduler", category="user")

    async def run() -> None:
        async def lookup(model_id: str) -> None:
            raise AssertionError("owners are cached")

        meter = ClockMeter(1000, lookup)
        span = meter.begin()
        assert metrics.REDIS_CALLER.get() == "clock_plan"  # the cycle's Redis round trips
        await meter.planned(span, queues, plan, runs=True)
        assert metrics.REDIS_CALLER.get() == "clock_dispatch"
        assert value("lockstep_queue_depth", owner="owner-b") == 2
        assert value("lockstep_tenants_waiting") == 1
        assert value("lockstep_futures_pending", kind="training") == 4
        assert value("lockstep_clock_busy_ratio") > 0  # the cycle is running
        meter.dispatched(span)
        assert metrics.REDIS_CALLER.get() == "clock_collect"
        meter.finished(span, plan, outcomes)
        await meter.planned(meter.begin(), {}, CyclePlan((), 1000), runs=False)

    asyncio.run(run())
    assert value("lockstep_cycle_tokens_total") - before["lockstep_cycle_tokens_total"] == 400
    assert (
        value("lockstep_cycle_token_budget_total") - before["lockstep_cycle_token_budget_total"]
        == 1000
    )
    assert value("lockstep_cycles_total", kind="work") - work_before == 1
    assert (
        value(
            "lockstep_tenant_requests_total", owner="owner-a", kind="forward_backward", outcome="ok"
        )
        - ok_before
        == 1
    )
    assert (
        value("lockstep_tenant_requests_total", owner="owner-b", kind="forward", outcome="failed")
        >= 1
    )
    assert value("lockstep_errors_total", component="scheduler", category="user") - user_errors == 1
    assert (
        value("lockstep_tenant_requests_total", owner="owner-b", kind="rejected", outcome="failed")
        == 0
    )  # counted at submission, not again here
    assert value("lockstep_queue_depth", owner="owner-b") == 0  # the queues emptied
    assert value("lockstep_clock_token_budget") == 1000


def test_engine_call_sets_the_phase_and_counts_time() -> None:
    before = value("lockstep_engine_busy_seconds_total", engine="trainer", phase="checkpoint")
    with metrics.engine_call("trainer", "save_state") as timer:
        assert (
            value("lockstep_engine_phase", engine="trainer", lockstep_engine_phase="checkpoint")
            == 1
        )
    assert value("lockstep_engine_phase", engine="trainer", lockstep_engine_phase="idle") == 1
    assert value(
        "lockstep_engine_busy_seconds_total", engine="trainer", phase="checkpoint"
    ) - before == pytest.approx(timer.seconds)


def test_redis_round_trips_are_counted_per_exchange_and_caller(clean_redis: str) -> None:
    """One command, one pipeline of three and one transaction: three round trips (and five
    commands), labelled with the caller set in the task; their seconds are counted too."""
    caller = "rpc:TestMethod"

    def trips() -> float:
        return value("lockstep_redis_round_trips_total", caller=caller)

    async def run() -> None:
        client = redis_conn.connect(clean_redis)
        await client.ping()  # the connection's set-up exchanges are not the test's
        before, seconds = trips(), value("lockstep_redis_round_trip_seconds_total", caller=caller)
        token = metrics.REDIS_CALLER.set(caller)
        try:
            await client.set("k", b"1")
            pipe = client.pipeline(transaction=False)
            pipe.incr("k").incr("k").get("k")
            assert (await pipe.execute())[-1] == b"3"
            await client.pipeline(transaction=True).incr("k").execute()
        finally:
            metrics.REDIS_CALLER.reset(token)
        assert trips() - before == 3
        assert value("lockstep_redis_round_trip_seconds_total", caller=caller) > seconds
        other = value("lockstep_redis_round_trips_total", caller="other")
        await client.get("k")  # outside the caller's scope: counted as "other"
        assert trips() - before == 3
        assert value("lockstep_redis_round_trips_total", caller="other") - other == 1
        await client.aclose()

    asyncio.run(run())


def test_submission_counts_new_requests_and_deduplicated_retries() -> None:
    new = value("lockstep_submissions_total", kind="optim_step")
    dup = value("lockstep_retries_deduplicated_total", kind="optim_step")
    metrics.submitted("o", "m-sub", "optim_step", created=True)
    metrics.submitted("o", "m-sub", "optim_step", created=False)
    assert value("lockstep_submissions_total", kind="optim_step") - new == 1
    assert value("lockstep_retries_deduplicated_total", kind="optim_step") - dup == 1
    assert metrics.OWNERS.get("m-sub") == "o"


@pytest.mark.parametrize(
    "status, category",
    [
        (200, None),
        (304, None),
        (400, "user"),
        (413, "user"),
        (401, "auth"),
        (404, "not_found"),
        (429, "capacity"),
        (503, "unavailable"),
        (500, "server"),
    ],
)
def test_http_error_categories(status: int, category: str | None) -> None:
    assert gateway_metrics.http_error_category(status) == category


# ---------------------------------------------------------------- the gateway's /metrics
def test_gateway_metrics_label_routes_by_template() -> None:
    with running_standin() as (_, address), gateway_client(address) as client:
        assert client.get("/api/v1/training_runs/run-123").status_code == 200
        assert client.get("/no/such/path").status_code == 404
        assert client.post("/api/v1/optim_step", content=b"{bad").status_code == 400
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    assert 'route="/api/v1/training_runs/{run_id}"' in text
    assert "run-123" not in text
    assert 'route="unmatched"' in text
    assert "lockstep_http_requests_in_flight 1.0" in text  # this scrape itself


# ---------------------------------------------------------------- the scheduler's ops server
def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture()
def ops_server() -> Iterator[tuple[OpsServer, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    import threading

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = OpsServer("127.0.0.1", 0, loop).start()
    yield server, loop
    server.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_ops_server_serves_metrics_and_health(
    ops_server: tuple[OpsServer, asyncio.AbstractEventLoop],
) -> None:
    server, _ = ops_server
    base = f"http://127.0.0.1:{server.port}"
    status, body = _get(base + "/metrics")
    assert status == 200 and "lockstep_cycle_duration_seconds_bucket" in body
    assert _get(base + "/livez")[0] == 200
    status, body = _get(base + "/healthz")
    assert status == 503 and json.loads(body)["status"] == "starting"
    parts = {"redis": "ready", "trainer": "ready", "sampler": "process exited"}

    async def health() -> dict[str, str]:
        return dict(parts)

    server.health = health
    status, body = _get(base + "/healthz")
    assert status == 503 and json.loads(body)["parts"]["sampler"] == "process exited"
    parts["sampler"] = "ready"
    assert _get(base + "/healthz")[0] == 200
    assert _get(base + "/nothing")[0] == 404


def test_ops_server_liveness_fails_when_the_loop_is_stuck(
    ops_server: tuple[OpsServer, asyncio.AbstractEventLoop], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, loop = ops_server
    monkeypatch.setattr("lockstep.observability.ops_server.PROBE_TIMEOUT_S", 0.3)
    import time

    loop.call_soon_threadsafe(time.sleep, 0.8)  # blocks the loop like a stuck coroutine
    assert _get(f"http://127.0.0.1:{server.port}/livez")[0] == 503
    time.sleep(0.8)  # let the loop drain before the fixture stops it


# ---------------------------------------------------------------- catalogue-level checks
def declared() -> set[str]:
    return exported_names([*metrics.SCHEDULER.collect(), *metrics.GATEWAY.collect()])


def test_dashboard_names_declared_metrics_and_is_well_formed() -> None:
    names = declared()
    board = dashboard()
    for where, expr in dashboard_queries(board).items():
        missing = promql_metric_names(expr) - names
        assert not missing, (where, missing)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_every_metric_appears_on_the_dashboard() -> None:
    used: set[str] = set()
    for expr in dashboard_queries(dashboard()).values():
        used |= promql_metric_names(expr)
    families = {
        m.name
        for m in [*metrics.SCHEDULER.collect(), *metrics.GATEWAY.collect()]
        if m.name.startswith("lockstep_")
    }
    unused = {f for f in families if not any(u.startswith(f) for u in used)}
    assert not unused


def test_alert_rules_name_declared_metrics() -> None:
    names = declared()
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        assert not promql_metric_names(rule["expr"]) - names, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_labels_stay_bounded() -> None:
    allowed = {
        "owner",
        "kind",
        "outcome",
        "phase",
        "engine",
        "component",
        "category",
        "method",
        "route",
        "status",
        "le",
        "version",
        "state_format",
        "lockstep_engine_phase",
        "action",
        "direction",
        "encoding",
        "form",
        "caller",
        "kernel",
        "implementation",
    }  # action: release | resume (sampler memory); direction: in | out | freed (model paging);
    # encoding: zstd | gzip | x-gzip | deflate (request bodies); form: wire | plain;
    # caller: rpc:<gRPC method> | RedisCaller (Redis round trips); kernel, implementation:
    # HybridKernel, KernelImpl (hybrid kernels)
    for registry in (metrics.SCHEDULER, metrics.GATEWAY):
        for family in registry.collect():
            if not family.name.startswith("lockstep_"):
                continue  # python_info, process_*: prometheus_client's own, fixed labels
            for sample in family.samples:
                extra: dict[str, Any] = {k: v for k, v in sample.labels.items() if k not in allowed}
                assert not extra, (sample.name, extra)
