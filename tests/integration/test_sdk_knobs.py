"""The SDK 0.38 client knobs against a real `lockstep serve`, seen in the gateway's /metrics:
the session poller (retrieve_futures), joining a sampling session, cancelling an abandoned
sample, and zstd fwd/bwd bodies; then the edge cases of retrieve_futures and cancel_future over
plain HTTP (unknown ids, finished futures, training futures, a cancelled queued sample that
never runs)."""

from __future__ import annotations

import os
import pickle
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import tinker
import zstandard
from tinker import types

from lockstep.devserver import Server, start_server, stop_server
from tests.promql import scrape, total

from .conftest import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

COUNT = "lockstep_http_request_duration_seconds_count"
WAIT_S = 60.0
BLOCK = 800  # tokens: a sample that keeps the sampling lane busy for a second or more
RUNNING = 64  # tokens: a sample in flight (or just done) while the sampling engine is stopped
MAX_BODY = 8_000_000  # --max-body-bytes of the second server


def _calls(server: Server, route: str, status: str = "200") -> float:
    return total(scrape(server.base_url + "/metrics"), COUNT, route=route, status=status)


def _prompt(seed: int) -> types.ModelInput:
    return types.ModelInput.from_ints([1 + seed, 2, 3, 4])


@pytest.fixture(scope="module")
def sampler(service_client: tinker.ServiceClient, base_model: str) -> tinker.SamplingClient:
    return service_client.create_sampling_client(base_model=base_model).result()


def test_config_advertises_the_knobs(server: Server) -> None:
    headers = {"X-API-Key": API_KEY}
    config = httpx.post(server.base_url + "/api/v1/client/config", headers=headers, json={})
    dynamic = httpx.post(server.base_url + "/api/v1/client/dynamic_config", headers=headers)
    assert config.json()["sample_use_retrieve_futures"] is True
    assert config.json()["sample_join_sampling_session"] is True
    assert config.json()["proto_compress_fwdbwd"] is False  # loopback: auto is off
    assert dynamic.json()["sample_cancel_enabled"] is True


def _scheduler_rpcs(metrics_port: int, method: str) -> float:
    found = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    return total(found, "lockstep_rpc_duration_seconds_count", method=method)


def test_samples_complete_through_the_session_poller(
    server: Server, sampler: tinker.SamplingClient, metrics_port: int
) -> None:
    """Each sample completes through the session's poll, which brings its answer along: the
    SDK's retrieve_future of it is answered by the gateway, never by the scheduler."""
    polls = _calls(server, "/api/v1/retrieve_futures")
    fetches = _calls(server, "/api/v1/retrieve_future")
    asked = _scheduler_rpcs(metrics_port, "RetrieveFuture")
    params = types.SamplingParams(max_tokens=4, temperature=1.0)
    futures = [
        sampler.sample(prompt=_prompt(i), num_samples=2, sampling_params=params) for i in range(6)
    ]
    for future in futures:
        result = future.result(timeout=WAIT_S)
        assert len(result.sequences) == 2
        assert all(len(s.tokens) >= 1 for s in result.sequences)
    assert _calls(server, "/api/v1/retrieve_futures") > polls
    assert _calls(server, "/api/v1/retrieve_future") - fetches == len(futures)
    assert _scheduler_rpcs(metrics_port, "RetrieveFuture") == asked


def test_an_unpickled_client_joins_its_sampling_session(
    server: Server, sampler: tinker.SamplingClient
) -> None:
    joins = _calls(server, "/api/v1/join_sampling_session")
    clone = pickle.loads(pickle.dumps(sampler))
    params = types.SamplingParams(max_tokens=3, temperature=1.0)
    out = clone.sample(prompt=_prompt(10), num_samples=1, sampling_params=params)
    assert len(out.result(timeout=WAIT_S).sequences) == 1
    assert _calls(server, "/api/v1/join_sampling_session") == joins + 1


def _wait_calls(server: Server, route: str, above: float) -> None:
    deadline = time.monotonic() + WAIT_S
    while _calls(server, route) <= above:
        assert time.monotonic() < deadline, f"no {route} call came"
        time.sleep(0.1)


@contextmanager
def _frozen(server: Server) -> Iterator[None]:
    """The server's sampling engine process stopped (SIGSTOP) for the block: no sample can be
    answered meanwhile, however fast or slow the box (a call in flight waits; its deadline is
    minutes away)."""
    pids = re.findall(r"sampler ready in process (\d+)", server.log())
    assert pids, "the scheduler logs its sampler's pid"
    pid = int(pids[-1])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_an_abandoned_sample_is_cancelled_on_the_server(server: Server, base_model: str) -> None:
    # A sampler of its own: the server names the sampler of each cancel it logs, so a late
    # cancel of another test's sample cannot pass for this one.
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    # Taken from its future: get_session below must see the sampler it created.
    sampler = service.create_sampling_client(base_model=base_model).result()
    rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
    (sampler_id,) = rest.get_session(service.holder.get_session_id()).result().sampler_ids
    sent = _calls(server, "/api/v1/asample")
    running = types.SamplingParams(max_tokens=RUNNING, temperature=1.0, stop=[])
    blocker = sampler.sample(prompt=_prompt(11), num_samples=1, sampling_params=running)
    _wait_calls(server, "/api/v1/asample", sent)
    short = types.SamplingParams(max_tokens=2, temperature=1.0)
    # Held by the stopped engine (queued, or in its call beside the blocker): it cannot be
    # answered before the client abandons it.
    with _frozen(server):
        victim = sampler.sample(prompt=_prompt(12), num_samples=1, sampling_params=short)
        _wait_calls(server, "/api/v1/asample", sent + 1)  # its future exists on the server
        victim.future().cancel()  # abandoned
        deadline = time.monotonic() + WAIT_S
        while f"of {sampler_id} cancelled by its client" not in server.log():
            assert time.monotonic() < deadline, "the abandoned sample was not cancelled"
            time.sleep(0.1)
    assert len(blocker.result(timeout=3 * WAIT_S).sequences[0].tokens) == RUNNING
    # the sampler still serves what comes next
    after = sampler.sample(prompt=_prompt(13), num_samples=1, sampling_params=short)
    assert len(after.result(timeout=WAIT_S).sequences) == 1


# ---------------------------------------------------------------- plain HTTP edge cases
@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=WAIT_S
    ) as client:
        yield client


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.fixture(scope="module")
def sampling_session(http: httpx.Client, base_model: str) -> str:
    session = _ok(http.post("/api/v1/create_session", json={"type": "create_session"}))
    created = _ok(
        http.post(
            "/api/v1/create_sampling_session",
            json={
                "session_id": session["session_id"],
                "sampling_session_seq_id": 0,
                "base_model": base_model,
            },
        )
    )
    sampler_id: str = created["sampling_session_id"]
    return sampler_id


def _asample(http: httpx.Client, sampler_id: str, seq_id: int, max_tokens: int) -> str:
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": seq_id,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": max_tokens, "temperature": 1.0, "stop": []},
    }
    request_id: str = _ok(http.post("/api/v1/asample", json=body))["request_id"]
    return request_id


def _retrieve(http: httpx.Client, request_id: str) -> httpx.Response:
    deadline = time.monotonic() + 3 * WAIT_S  # a blocker runs for seconds, more on a busy box
    while time.monotonic() < deadline:
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert answer.status_code == 200, answer.text
        if not answer.headers["content-type"].startswith("application/json"):
            return answer
        if answer.json().get("type") != "try_again":
            return answer
    raise AssertionError(f"{request_id} did not complete in {3 * WAIT_S}s")


def _poll(
    http: httpx.Client, sampler_id: str, cursor: int, clone: int = 0, **extra: Any
) -> dict[str, Any]:
    target = {"type": "sampling_session", "sampling_session_id": sampler_id}
    body = {"target": {**target, "cloned_sampler_id": clone}, "prev_cursor": cursor, **extra}
    return _ok(http.post("/api/v1/retrieve_futures", json=body))


def test_a_cancelled_queued_sample_never_runs(
    server: Server, http: httpx.Client, sampling_session: str
) -> None:
    blocker = _asample(http, sampling_session, 1, BLOCK)
    # The engine stopped: the victim is queued behind the blocker (or held in the engine's call
    # beside it), and the cancel is written first however fast the box samples.
    with _frozen(server):
        victim = _asample(http, sampling_session, 2, 2)
        cancelled = _ok(http.post("/api/v1/cancel_future", json={"request_id": victim}))
    assert cancelled == {"request_id": victim, "outcome": "cancelled"}
    answer = _retrieve(http, victim).json()
    assert answer["category"] == "user" and "cancelled" in answer["error"], answer
    assert _retrieve(http, blocker).headers["content-type"].startswith("application/x-protobuf")
    # the lane is done with the batch after the blocker: the victim still has no result
    assert "cancelled" in _retrieve(http, victim).json()["error"]
    again = _ok(http.post("/api/v1/cancel_future", json={"request_id": victim}))
    assert again["outcome"] == "already_failed"
    done = _ok(http.post("/api/v1/cancel_future", json={"request_id": blocker}))
    assert done["outcome"] == "already_finished"

    # the session poller sees both, each once, with the payload size of the finished one
    completions: dict[str, dict[str, Any]] = {}
    cursor = 0
    while len(completions) < 2:
        page = _poll(http, sampling_session, cursor, timeout=5.0)
        for item in page["completions"]:
            assert item["request_id"] not in completions, "reported twice"
            completions[item["request_id"]] = item
        cursor = page["cursor"]
    assert completions[victim]["state"] == "failed"
    assert completions[blocker]["state"] == "finished"
    assert completions[blocker]["response_payload_uncompressed_size"] > 0
    assert _poll(http, sampling_session, cursor, timeout=0) == {
        "completions": [],
        "cursor": cursor,
    }


def test_retrieve_futures_waits_for_the_next_completion(
    http: httpx.Client, sampling_session: str
) -> None:
    cursor = _poll(http, sampling_session, 0, timeout=0)["cursor"]
    clone = _ok(
        http.post("/api/v1/join_sampling_session", json={"sampling_session_id": sampling_session})
    )["client_counter"]
    assert clone >= 1
    rid = _asample(http, sampling_session, clone * 1_000_000_000, 2)
    page = _poll(http, sampling_session, 0, clone=clone, timeout=20.0)  # held until it is done
    assert [c["request_id"] for c in page["completions"]] == [rid]
    # the original client's log did not get the clone's sample
    assert _poll(http, sampling_session, cursor, timeout=0)["completions"] == []


def test_retrieve_futures_and_cancel_refuse_what_they_cannot_answer(
    http: httpx.Client, sampling_session: str, base_model: str
) -> None:
    unknown = http.post(
        "/api/v1/retrieve_futures",
        json={"target": {"type": "sampling_session", "sampling_session_id": "sess-x:sample:9"}},
    )
    assert unknown.status_code == 404 and "sess-x:sample:9" in unknown.json()["detail"]
    ahead = http.post(
        "/api/v1/retrieve_futures",
        json={
            "target": {"type": "sampling_session", "sampling_session_id": sampling_session},
            "prev_cursor": 10**12,
        },
    )
    assert ahead.status_code == 400 and "prev_cursor" in ahead.json()["detail"]
    wrong = http.post(
        "/api/v1/retrieve_futures",
        json={"target": {"type": "training_run", "sampling_session_id": sampling_session}},
    )
    assert wrong.status_code == 400 and "target.type" in wrong.json()["detail"]

    missing = http.post("/api/v1/cancel_future", json={"request_id": "req-0000000000000000"})
    assert missing.status_code == 404 and "req-0000000000000000" in missing.json()["detail"]
    session = _ok(http.post("/api/v1/create_session", json={"type": "create_session"}))
    created = _ok(
        http.post(
            "/api/v1/create_model",
            json={
                "session_id": session["session_id"],
                "model_seq_id": 0,
                "base_model": base_model,
                "lora_config": {"rank": 4},
            },
        )
    )
    training = http.post("/api/v1/cancel_future", json={"request_id": created["request_id"]})
    assert training.status_code == 400, training.text
    assert "only samples can be cancelled" in training.json()["detail"]
    unknown_join = http.post(
        "/api/v1/join_sampling_session", json={"sampling_session_id": "sess-x:sample:9"}
    )
    assert unknown_join.status_code == 404


# ---------------------------------------------------------------- the other settings
@pytest.fixture(scope="module")
def knobs_off_compression_on(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("knobs") / "data",
        "--fwdbwd-compression",
        "on",
        "--sample-polling",
        "per-request",
        "--max-body-bytes",
        str(MAX_BODY),
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def test_zstd_bodies_and_per_request_polling(
    knobs_off_compression_on: Server, base_model: str
) -> None:
    srv = knobs_off_compression_on
    client = tinker.ServiceClient(base_url=srv.base_url, api_key=API_KEY)
    trainer = client.create_lora_training_client(base_model=base_model, rank=4).result()
    tokens = list(range(1, 200))
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=tokens[1:], dtype="int64")},
    )
    out = trainer.forward_backward([datum] * 4, "cross_entropy").result(timeout=WAIT_S)
    assert out.metrics["loss:sum"] > 0
    g = scrape(srv.base_url + "/metrics")
    assert total(g, "lockstep_http_compressed_bodies_total", encoding="zstd") >= 1
    wire = total(g, "lockstep_http_compressed_body_bytes_total", encoding="zstd", form="wire")
    plain = total(g, "lockstep_http_compressed_body_bytes_total", encoding="zstd", form="plain")
    assert 0 < wire < plain  # repeated datums compress

    sampler = trainer.save_weights_and_get_sampling_client().result(timeout=WAIT_S)
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result(WAIT_S)
    assert len(result.sequences) == 1
    assert _calls(srv, "/api/v1/retrieve_futures") == 0  # one long-poll per sample instead
    assert _calls(srv, "/api/v1/retrieve_future") >= 1


def test_a_zstd_bomb_is_refused_at_the_decompressed_limit(knobs_off_compression_on: Server) -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (MAX_BODY + 1))
    assert len(bomb) < 10_000
    answer = httpx.post(
        knobs_off_compression_on.base_url + "/api/v1/forward_backward",
        content=bomb,
        headers={
            "X-API-Key": API_KEY,
            "Content-Type": "application/x-protobuf",
            "Content-Encoding": "zstd",
        },
        timeout=WAIT_S,
    )
    assert answer.status_code == 413, answer.text
    assert str(MAX_BODY) in answer.json()["detail"]
    assert "decompressed" in answer.json()["detail"]
