"""Operating Lockstep: a real `lockstep serve`, a two-tenant training loop through the SDK, then
the gateway's and the scheduler's /metrics (the dashboard and the alert rules are evaluated on a
real Prometheus in test_prometheus.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import tinker
from prometheus_client.metrics_core import Metric
from tinker import types

from lockstep.gateway.deps import owner_of
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME
from lockstep.ports import free_port
from lockstep.scheduler.cycle.pace import MIN_CYCLE_TOKENS
from tests.promql import samples, scrape, total

from .conftest import Server, start_server, stop_server

pytestmark = pytest.mark.e2e
KEYS = ("tml-metrics-tenant-a", "tml-metrics-tenant-b")
STEPS = 6


@dataclass
class Scrapes:
    gateway: list[Metric]
    scheduler: list[Metric]

    @property
    def both(self) -> list[Metric]:
        return self.gateway + self.scheduler


def _datum(n: int = 48) -> types.Datum:
    tokens = np.arange(1, n + 2) % 900 + 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": tokens[1:].tolist()},
    )


def _tenant(server: Server, key: str, barrier: threading.Barrier) -> None:
    """A pipelined training loop, then sampling from the trained adapter."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model=DEFAULT_MODEL_NAME, rank=8).result()
    barrier.wait(60)
    adam = types.AdamParams(learning_rate=1e-3)
    pending = []
    for _ in range(STEPS):
        pending.append(
            (trainer.forward_backward([_datum()], "cross_entropy"), trainer.optim_step(adam))
        )
        if len(pending) > 1:
            fb, opt = pending.pop(0)
            fb.result()
            opt.result()
    for fb, opt in pending:
        fb.result()
        opt.result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    out = sampler.sample(
        prompt=types.ModelInput.from_ints([1, 2, 3, 4]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4),
    ).result()
    assert len(out.sequences) == 2


def _retry_and_errors(server: Server) -> None:
    """A resubmitted create_model (deduplicated) and a request for an unknown run (404)."""
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEYS[0]}, timeout=60) as http:
        session = http.post(
            "/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "test", "type": "create_session"},
        )
        body = {
            "session_id": session.json()["session_id"],
            "model_seq_id": 0,
            "base_model": DEFAULT_MODEL_NAME,
            "lora_config": {"rank": 4},
            "type": "create_model",
        }
        first = http.post("/api/v1/create_model", json=body).json()
        again = http.post("/api/v1/create_model", json=body).json()
        assert first["request_id"] == again["request_id"]
        assert http.get("/api/v1/training_runs/no-such-run:train:0").status_code == 404


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrapes]:
    metrics_port = free_port()
    server = start_server(
        tmp_path_factory.mktemp("metrics") / "data", "--metrics-port", str(metrics_port)
    )
    try:
        barrier = threading.Barrier(len(KEYS))
        errors: list[BaseException] = []

        def run(key: str) -> None:
            try:
                _tenant(server, key, barrier)
            except BaseException as exc:  # surfaced below, with the server log
                errors.append(exc)
                barrier.abort()

        threads = [threading.Thread(target=run, args=(key,)) for key in KEYS]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, f"{errors!r}\n{server.log()[-3000:]}"
        _retry_and_errors(server)
        # The queue gauges are refreshed when the clock next plans; give it a moment to settle.
        deadline = time.monotonic() + 15
        while True:
            sched = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            settled = (
                total(sched, "lockstep_queue_depth") == 0
                and total(sched, "lockstep_futures_pending") == 0
            )
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        yield Scrapes(scrape(server.base_url + "/metrics"), sched)
    finally:
        code = stop_server(server)
    assert code == 0, server.log()[-3000:]


def test_two_tenant_loop_shows_in_metrics(scrapes: Scrapes) -> None:
    s = scrapes.scheduler
    cycles = total(s, "lockstep_cycle_duration_seconds_count")
    assert cycles > 0 and total(s, "lockstep_cycles_total", kind="work") == cycles
    # utilization: packed tokens / budget, and busy time / wall time
    util = total(s, "lockstep_cycle_token_utilization_ratio_sum") / total(
        s, "lockstep_cycle_token_utilization_ratio_count"
    )
    assert 0 < util <= 1
    assert total(s, "lockstep_cycle_tokens_total") / total(
        s, "lockstep_cycle_token_budget_total"
    ) == pytest.approx(util, rel=1e-6)
    assert 0 < total(s, "lockstep_clock_busy_ratio") <= 1
    assert total(s, "lockstep_clock_busy_seconds_total") > 0
    # two tenants: both owners have series, and some cycle packed both adapters
    owners = {x.labels["owner"] for x in samples(s, "lockstep_tenant_requests_total")}
    assert owners == {owner_of(k) for k in KEYS}
    for owner in owners:
        assert (
            total(
                s,
                "lockstep_tenant_requests_total",
                owner=owner,
                kind="forward_backward",
                outcome="ok",
            )
            == STEPS
        )
        assert (
            total(s, "lockstep_tenant_tokens_total", owner=owner, kind="forward_backward")
            == STEPS * 48
        )
        assert total(s, "lockstep_tenant_tokens_total", owner=owner, kind="sample") > 0
    one_tenant = total(s, "lockstep_cycle_tenants_bucket", le="1.0")
    assert total(s, "lockstep_cycle_tenants_count") > one_tenant, "no cycle had two tenants"
    assert {x.labels["owner"] for x in samples(s, "lockstep_queue_depth")} >= owners
    assert total(s, "lockstep_queue_depth") == 0  # everything ran
    assert total(s, "lockstep_futures_pending") == 0
    # the rest of the scheduler's catalogue
    assert total(s, "lockstep_retries_deduplicated_total", kind="create_model") == 1
    assert total(s, "lockstep_errors_total", component="scheduler", category="not_found") >= 1
    assert total(s, "lockstep_adapter_publish_duration_seconds_count") >= 2
    assert total(s, "lockstep_sampler_tokens_total") > 0
    assert total(s, "lockstep_engine_busy_seconds_total", engine="trainer", phase="train") > 0
    assert total(s, "lockstep_engine_busy_seconds_total", engine="sampler", phase="sample") > 0
    assert total(s, "lockstep_engine_phase", engine="trainer", lockstep_engine_phase="idle") == 1
    assert total(s, "lockstep_redis_rtt_seconds_count") >= 1
    # The pace the last plan set: --token-budget if one model was ready then, else a shared
    # cycle's share (at least MIN_CYCLE_TOKENS); which one depends on the timing of the end.
    assert MIN_CYCLE_TOKENS <= total(s, "lockstep_clock_token_budget") <= 65536


def test_gateway_latency_histograms(scrapes: Scrapes) -> None:
    g = scrapes.gateway
    for route in (
        "/api/v1/forward_backward",
        "/api/v1/optim_step",
        "/api/v1/retrieve_future",
        "/api/v1/asample",
    ):
        count = total(g, "lockstep_http_request_duration_seconds_count", route=route, status="200")
        assert count > 0, route
        buckets = samples(
            g, "lockstep_http_request_duration_seconds_bucket", route=route, status="200"
        )
        assert max(b.value for b in buckets) == count  # the +Inf bucket holds them all
    run_routes = {
        x.labels["route"]
        for x in samples(g, "lockstep_http_request_duration_seconds_count", status="404")
    }
    assert run_routes == {"/api/v1/training_runs/{run_id}"}  # a template, not the raw path
    assert total(g, "lockstep_errors_total", component="gateway", category="not_found") >= 1
