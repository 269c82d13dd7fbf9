"""A Redis at its memory limit (docs/operations.md, "Redis memory"), on a real `lockstep serve`
whose embedded Redis has a small limit: something else fills it (a key of another user of the
same Redis).

- Past 90 % of the limit, new work is refused with a 429 that says why and when to come back;
  an SDK call meanwhile keeps retrying, and goes through once there is room.
- At the limit itself (the limit lowered under what Redis holds) Redis refuses every write: a
  cycle that ran meanwhile cannot record its outcomes, and runs again once there is room, on
  its models' recorded state.

Nothing is lost and nothing is applied twice: every future completes, and the tenant's losses
equal those of a tenant trained without any of it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import tinker
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.devserver import Server, start_server, stop_server
from lockstep.ports import free_port
from tests.promql import scrape, total

from .conftest import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
LIMIT_MB = 48
BASE = "Lockstep/tiny-qwen3"
ADAM = types.AdamParams(learning_rate=2e-3)
FILLER = "another-service:blob"  # not Lockstep's: something else sharing its Redis
WAIT_S = 300


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    data = tmp_path_factory.mktemp("redis-memory") / "data"
    port = free_port()
    server = start_server(data, "--redis-maxmemory-mb", str(LIMIT_MB), "--metrics-port", str(port))
    yield server, port
    code = stop_server(server)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{server.log()[-5000:]}"


def _redis(server: Server) -> redis.Redis:
    return redis.Redis.from_url((server.data_dir / "redis" / "url").read_text())


def _fill(r: redis.Redis, to: float) -> None:
    """Grow the filler until Redis uses `to` x its limit (in small writes: a write's own
    bytes count against the limit while Redis reads it)."""
    limit = int(r.info("memory")["maxmemory"])
    while int(r.info("memory")["used_memory"]) < to * limit:
        r.append(FILLER, b"x" * (256 << 10))


def _refused(http: httpx.Client) -> httpx.Response:
    """A submission (for no run of ours: admission refuses before it reads anything)."""
    body = {"model_id": "sess-none:train:0", "seq_id": 1, "type": "optim_step"}
    return http.post("/api/v1/optim_step", json={**body, "adam_params": {"learning_rate": 1e-3}})


def _wait_for(what: str, condition: Any) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _trainer_pid(server: Server) -> int:
    pids = re.findall(r"trainer ready in process (\d+)", server.log())
    assert pids, "the scheduler logs its trainer's pid"
    return int(pids[-1])


def _losses(trainer: Any, data: list[Any], steps: range) -> list[float]:
    out = []
    for k in steps:
        fb = trainer.forward_backward([data[k % len(data)]], "cross_entropy")
        optim = trainer.optim_step(ADAM)
        out.append(fb.result(timeout=WAIT_S).metrics["loss:sum"])
        optim.result(timeout=WAIT_S)
    return out


def test_a_full_redis_refuses_new_work_and_loses_nothing(limited: tuple[Server, int]) -> None:
    server, metrics_port = limited
    r = _redis(server)
    assert int(r.info("memory")["maxmemory"]) == LIMIT_MB << 20
    assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainer = service.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    data = quickstart_data(trainer.get_tokenizer())
    losses = _losses(trainer, data, range(3))
    http = httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=60)

    # Past 90 %: a submission is a 429 saying why, and an SDK call keeps retrying meanwhile.
    _fill(r, 0.95)
    _wait_for("admission never paused", lambda: _refused(http).status_code == 429)
    refused = _refused(http)
    assert refused.headers["retry-after"] == "1"
    assert "Redis holds" in refused.text and "memory limit" in refused.text, refused.text
    seen_429 = _status_count(server, "/api/v1/forward_backward", "429")
    waiting: list[float] = []
    call = threading.Thread(target=lambda: waiting.extend(_losses(trainer, data, range(3, 4))))
    call.start()
    _wait_for(
        "the SDK's call was not refused",
        lambda: _status_count(server, "/api/v1/forward_backward", "429") > seen_429,
    )
    assert call.is_alive() and not waiting
    r.delete(FILLER)
    call.join(WAIT_S)
    assert len(waiting) == 1
    losses += waiting
    assert "refusing new work" in server.log() and "accepting new work again" in server.log()

    # At the limit: a cycle that ran meanwhile cannot be recorded; it runs again with room.
    failed_before = server.log().count("clock cycle failed")
    trainer_pid = _trainer_pid(server)
    os.kill(trainer_pid, signal.SIGSTOP)  # the cycle waits in the engine while Redis fills
    try:
        fb = trainer.forward_backward([data[4 % len(data)]], "cross_entropy")
        optim = trainer.optim_step(ADAM)
        _wait_for("the step never reached the engine", lambda: _training(metrics_port))
        # Redis at its limit: it refuses every write from now on.
        r.config_set("maxmemory", int(r.info("memory")["used_memory"]) - (1 << 20))
    finally:
        os.kill(trainer_pid, signal.SIGCONT)
    _wait_for(
        "Redis never refused the cycle's commit",
        lambda: server.log().count("clock cycle failed") > failed_before,
    )
    assert not fb.future().done()
    r.config_set("maxmemory", LIMIT_MB << 20)
    losses.append(fb.result(timeout=WAIT_S).metrics["loss:sum"])
    optim.result(timeout=WAIT_S)
    losses += _losses(trainer, data, range(5, 7))

    # The same steps on a tenant that saw none of it.
    reference = service.create_lora_training_client(base_model=BASE, rank=4, seed=7).result()
    np.testing.assert_allclose(
        losses, _losses(reference, data, range(len(losses))), rtol=1e-5, atol=1e-6
    )


def _status_count(server: Server, route: str, status: str) -> float:
    found = scrape(server.base_url + "/metrics")
    return total(found, "lockstep_http_request_duration_seconds_count", route=route, status=status)


def _training(metrics_port: int) -> bool:
    """The scheduler is inside a training engine call (stopped: it stays there)."""
    found = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    phase = total(found, "lockstep_engine_phase", engine="trainer", lockstep_engine_phase="train")
    return phase > 0
