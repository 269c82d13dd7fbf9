"""A restarted gateway still answers futures (they live in Redis); keys see only their own runs."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import tinker

from lockstep.demo import quickstart_data

from .conftest import API_KEY, Server, start_server, stop_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("restart") / "data")
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def _child(server: Server, module: str) -> psutil.Process:
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if module in " ".join(proc.cmdline()):
            return proc
    raise AssertionError(f"no {module} process under lockstep serve")


def _wait_healthy(server: Server, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(server.base_url + "/api/v1/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError("server did not become healthy again")


def test_a_killed_gateway_is_restarted_and_old_futures_still_answer(
    own_server: Server, base_model: str
) -> None:
    client = tinker.ServiceClient(base_url=own_server.base_url, api_key=API_KEY)
    trainer = client.create_lora_training_client(base_model=base_model, rank=4).result()
    data = quickstart_data(trainer.get_tokenizer())[:2]
    with httpx.Client(
        base_url=own_server.base_url, headers={"X-API-Key": API_KEY}, timeout=60
    ) as http:
        session = http.post(
            "/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "test", "type": "create_session"},
        ).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": base_model,
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        ).json()
        gateway = _child(own_server, "lockstep.gateway")
        os.kill(gateway.pid, signal.SIGKILL)
        gateway.wait(10)
        _wait_healthy(own_server)
        assert _child(own_server, "lockstep.gateway").pid != gateway.pid
        answer = http.post(
            "/api/v1/retrieve_future",
            json={"request_id": created["request_id"], "allow_metadata_only": False},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model_id"] == f"{session}:train:0"
    # the SDK client made before the restart carries on
    loss = trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    assert loss > 0


def test_another_key_sees_nothing_of_mine(
    server: Server, service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    path = trainer.save_state("private").result().path
    other = {"X-API-Key": "tml-someone-else"}
    with httpx.Client(base_url=server.base_url, headers=other, timeout=30) as http:
        run = trainer.model_id
        assert http.get(f"/api/v1/training_runs/{run}").status_code == 404
        assert http.get(f"/api/v1/training_runs/{run}/checkpoints").status_code == 404
        assert (
            http.post("/api/v1/get_info", json={"model_id": run, "type": "get_info"}).status_code
            == 404
        )
        listing = http.get("/api/v1/checkpoints").json()["checkpoints"]
        assert all(c["tinker_path"] != path for c in listing)
        session = http.post(
            "/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"},
        ).json()["session_id"]
        r = http.post(
            "/api/v1/load_weights",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "path": path,
                "optimizer": False,
                "type": "load_weights",
            },
        )
        assert r.status_code == 404, r.text
        r = http.post(
            "/api/v1/optim_step",
            json={
                "model_id": run,
                "seq_id": 99,
                "type": "optim_step",
                "adam_params": {"learning_rate": 0.1},
            },
        )
        assert r.status_code == 404, r.text
    # once published, the checkpoint is readable by every key
    rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
    rest.publish_checkpoint_from_tinker_path(path).result()
    with httpx.Client(base_url=server.base_url, headers=other, timeout=30) as http:
        r = http.post("/api/v1/weights_info", json={"tinker_path": path})
        assert r.status_code == 200 and r.json()["lora_rank"] == 4, r.text
