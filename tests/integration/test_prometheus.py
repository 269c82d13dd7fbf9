"""The dashboard and the alert rules on a real Prometheus scraping a live `lockstep serve`.

A `prometheus` server (the system package; README's test command installs it where it can)
scrapes the gateway and the scheduler every second, on loopback only, while two tenants train.
Then every Grafana panel query and every alert expression is evaluated through Prometheus' HTTP
API, the core panels must show data, the rules must load healthy, and `promtool check rules`
must accept the shipped rule file.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import yaml
from tinker import types

from lockstep.gateway.deps import owner_of
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME
from lockstep.supervisor import free_port
from tests.promql import ALERTS, alert_rules, dashboard, dashboard_queries, grafana_to_promql

from .conftest import start_server, stop_server

pytestmark = pytest.mark.e2e
KEYS = ("tml-prometheus-tenant-a", "tml-prometheus-tenant-b")
STEPS = 5
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
MISSING = (
    "\n\n*** SKIPPED: the real-Prometheus checks of the Grafana dashboard and the alert rules "
    "did NOT run: no `prometheus`/`promtool` on PATH. Install Debian's package (as root: "
    "`apt-get install -y prometheus`; README's test command does this when run as root). ***\n"
)
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason=MISSING)
if PROMETHEUS is None or PROMTOOL is None:  # also in the warnings summary, which -q still shows
    warnings.warn(MISSING, UserWarning, stacklevel=1)

# Panels an operator looks at first: they must show numbers after a two-tenant run.
CORE_PANELS = (
    "Cycle duration",
    "Busy time ÷ wall time",
    "Tenants per cycle",
    "Tokens / s per owner",
    "Queue depth per owner",
    "Request latency p99 by endpoint",
    "Request latency p50 by endpoint",
)
# Panels whose series legitimately do not exist in this run: a local sampler never changes
# memory state (vLLM/SGLang colocated do), and Redis never failed a ping.
NO_SERIES_HERE = {
    "Engine time by phase #1": "sampler memory transitions (colocated HTTP samplers only)",
    "Redis ping failures #0": "lockstep_errors_total{category=redis} (no Redis failure here)",
    "Failed requests / s per owner #0": "no request failed in this run",
    "Page-ins / outs / frees #0": "no run is paged, freed or restored (no --max-resident-models, "
    "no session ends during the run)",
    "Hybrid kernels #0": "lockstep_hybrid_kernel is exported for hybrid models only (this run "
    "serves the dense tiny Qwen3; test_model_families.py reads it for every hybrid family)",
}


@dataclass
class Run:
    prometheus: str  # base URL of the Prometheus HTTP API
    start: float
    end: float


def _datum(n: int = 48) -> types.Datum:
    tokens = np.arange(1, n + 2) % 900 + 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": tokens[1:].tolist()},
    )


def _tenant(base_url: str, key: str, barrier: threading.Barrier) -> None:
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(base_model=DEFAULT_MODEL_NAME, rank=8).result()
    adam = types.AdamParams(learning_rate=1e-3)
    for step in range(STEPS):
        fb = trainer.forward_backward([_datum()], "cross_entropy")
        opt = trainer.optim_step(adam)
        fb.result()
        opt.result()
        if step == 0:  # both tenants' counters exist and were scraped: rates see the rest
            barrier.wait(120)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    sampler.sample(
        prompt=types.ModelInput.from_ints([1, 2, 3, 4]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4),
    ).result()


def _scraped_both_owners(prometheus: str) -> None:
    """Until Prometheus holds a token counter of every tenant. A run shorter than one scrape
    interval would otherwise show up only at its final value, and rate() of a series that first
    appears at its final value is 0."""
    deadline = time.monotonic() + 60
    query = "count by (owner) (lockstep_tenant_tokens_total)"
    while len(_api(prometheus, "query", query=query)["result"]) < len(KEYS):
        assert time.monotonic() < deadline, "Prometheus never scraped both tenants' counters"
        time.sleep(0.5)


def _two_tenants(base_url: str, prometheus: str) -> None:
    barrier = threading.Barrier(len(KEYS), action=lambda: _scraped_both_owners(prometheus))
    errors: list[BaseException] = []

    def run(key: str) -> None:
        try:
            _tenant(base_url, key, barrier)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(key,)) for key in KEYS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors


def _retry_and_error(base_url: str) -> None:
    """A resubmitted create_model (deduplicated) and an unknown run (404), for their panels."""
    with httpx.Client(base_url=base_url, headers={"X-API-Key": KEYS[0]}, timeout=60) as http:
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
        assert http.post("/api/v1/create_model", json=body).json() == first
        assert http.get("/api/v1/training_runs/no-such-run:train:0").status_code == 404


def _config(path: Path, gateway: str, scheduler: str) -> None:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "lockstep-gateway", "static_configs": [{"targets": [gateway]}]},
            {"job_name": "lockstep-scheduler", "static_configs": [{"targets": [scheduler]}]},
        ],
    }
    path.write_text(yaml.safe_dump(config))


def _api(base: str, path: str, **params: Any) -> Any:
    response = httpx.get(f"{base}/api/v1/{path}", params=params, timeout=30)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (path, params, body)
    return body["data"]


def _wait_for_targets(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    targets: list[dict[str, Any]] = []
    while True:
        try:
            # 503 "Service Unavailable" (not JSON) until its storage is open
            if httpx.get(f"{base}/-/ready", timeout=30).status_code == 200:
                targets = _api(base, "targets")["activeTargets"]
                if len(targets) == 2 and all(t["health"] == "up" for t in targets):
                    return
        except httpx.HTTPError:
            targets = []
        assert time.monotonic() < deadline, f"targets not up: {targets}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    assert PROMETHEUS is not None
    tmp = tmp_path_factory.mktemp("prometheus")
    metrics_port = free_port()
    # Compressed fwd/bwd bodies (off by default on a loopback bind) so their panel has data.
    server = start_server(
        tmp / "data", "--metrics-port", str(metrics_port), "--fwdbwd-compression", "on"
    )
    prom_port = free_port()
    _config(
        tmp / "prometheus.yml", server.base_url.removeprefix("http://"), f"127.0.0.1:{metrics_port}"
    )
    log = (tmp / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",  # loopback only
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{prom_port}"
    try:
        _wait_for_targets(base)
        start = time.time()
        _two_tenants(server.base_url, base)
        _retry_and_error(server.base_url)
        time.sleep(5)  # a few more scrapes and rule evaluations after the last request
        yield Run(base, start, time.time())
    finally:
        prom.terminate()
        try:
            prom.wait(30)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait(10)
        log.close()
        code = stop_server(server)
    assert code == 0, server.log()[-3000:]


def _range(run: Run, expr: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = _api(
        run.prometheus, "query_range", query=expr, start=run.start, end=run.end, step="1s"
    )["result"]
    return result


def _finite(series: list[dict[str, Any]]) -> list[float]:
    return [float(v) for s in series for _, v in s["values"] if math.isfinite(float(v))]


@needs_prometheus
def test_every_panel_query_evaluates_and_the_core_panels_show_data(run: Run) -> None:
    queries = dashboard_queries(dashboard())
    assert len(queries) >= 20
    empty = []
    for where, expr in queries.items():
        series = _range(run, grafana_to_promql(expr))  # a query Prometheus refuses fails here
        if not series and where not in NO_SERIES_HERE:
            empty.append((where, expr))
    assert not empty, f"panel queries with no series after a two-tenant run: {empty}"

    by_panel: dict[str, list[float]] = {}
    for where, expr in queries.items():
        by_panel.setdefault(where.rsplit(" #", 1)[0], []).extend(
            _finite(_range(run, grafana_to_promql(expr)))
        )
    for panel in CORE_PANELS:
        values = by_panel[panel]
        assert values, f"{panel}: no finite value"
        if panel != "Queue depth per owner":  # a drained queue is 0, a value all the same
            assert max(values) > 0, (panel, values[:20])
    assert 1 <= max(by_panel["Tenants per cycle"])  # mean tenants per cycle, p90, waiting

    # The $owner variable lists both tenants.
    owners = _api(
        run.prometheus, "label/owner/values", **{"match[]": "lockstep_tenant_requests_total"}
    )
    assert set(owners) >= {owner_of(k) for k in KEYS}


@needs_prometheus
def test_every_alert_expression_evaluates_and_the_rules_load_healthy(run: Run) -> None:
    rules = alert_rules()
    assert len(rules) >= 8
    for rule in rules:
        _api(run.prometheus, "query", query=rule["expr"], time=run.end)  # no error
    loaded = [r for g in _api(run.prometheus, "rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in loaded} == {r["alert"] for r in rules}
    for r in loaded:
        assert r["health"] == "ok" and not r.get("lastError"), r
    # A healthy two-tenant run fires no critical alert.
    firing = _api(run.prometheus, "alerts")["alerts"]
    assert not [a for a in firing if a["labels"].get("severity") == "critical"], firing


@needs_prometheus
def test_promtool_accepts_the_shipped_rules() -> None:
    assert PROMTOOL is not None
    out = subprocess.run(
        [PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
