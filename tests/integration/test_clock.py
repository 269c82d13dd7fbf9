"""The clock seen from the SDK: cycles per step, tenants sharing cycles, chunks, replays."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.config.sections import ClockConfig
from lockstep.wire.v1 import tinker_pb2 as wire

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-4)
TOKEN_BUDGET = ClockConfig().token_budget  # the session server's (its default)


def _datum(n: int = 64) -> types.Datum:
    tokens = np.arange(1, n + 2) % 1000
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1].tolist()),
        loss_fn_inputs={"target_tokens": tokens[1:].tolist()},
    )


def _cycle(result: types.ForwardBackwardOutput) -> int:
    value = result.metrics["clock_cycle:unique"]
    assert float(value).is_integer()
    return int(value)


def pipelined(trainer: tinker.TrainingClient, steps: int) -> list[int]:
    """Submit step k, then wait for step k-1 (the docs' pipelined loop)."""
    cycles, prev = [], None
    data = [_datum()]
    for _ in range(steps):
        fb, opt = trainer.forward_backward(data, "cross_entropy"), trainer.optim_step(ADAM)
        if prev is not None:
            cycles.append(_cycle(prev[0].result()))
            prev[1].result()
        prev = (fb, opt)
    assert prev is not None
    cycles.append(_cycle(prev[0].result()))
    prev[1].result()
    return cycles


def naive(trainer: tinker.TrainingClient, steps: int) -> list[int]:
    """Wait for forward_backward, only then submit optim_step."""
    cycles = []
    for _ in range(steps):
        cycles.append(_cycle(trainer.forward_backward([_datum()], "cross_entropy").result()))
        trainer.optim_step(ADAM).result()
    return cycles


def deltas(cycles: list[int]) -> list[int]:
    return [b - a for a, b in zip(cycles, cycles[1:], strict=False)]


def new_trainer(service_client: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(base_model=base_model, rank=8).result()


def test_pipelined_loop_uses_one_cycle_per_step_and_naive_two(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    piped = pipelined(new_trainer(service_client, base_model), 8)
    assert statistics.median(deltas(piped)) == 1, piped
    slow = naive(new_trainer(service_client, base_model), 6)
    assert statistics.median(deltas(slow)) >= 2, slow
    assert all(d > 0 for d in deltas(piped) + deltas(slow)), "cycle ids only increase"


def test_two_pipelined_tenants_share_their_cycles(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainers = [new_trainer(service_client, base_model) for _ in range(2)]
    results: dict[int, list[int]] = {}
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = pipelined(trainers[i], 10)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    a, b = set(results[0]), set(results[1])
    shared = len(a & b) / min(len(a), len(b))
    assert shared >= 0.8, (results, shared)


def pace_now(metrics_port: int) -> float:
    """The pass tokens one model may pack in a cycle, as of the last cycle planned."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith("lockstep_clock_token_budget "):
            return float(line.split()[1])
    raise AssertionError("no lockstep_clock_token_budget in /metrics")


def test_all_chunks_of_a_large_call_land_in_one_cycle(
    service_client: tinker.ServiceClient, base_model: str, metrics_port: int
) -> None:
    trainer = new_trainer(service_client, base_model)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([i % 900 + 1]),
            loss_fn_inputs={"target_tokens": [(i + 1) % 900 + 1]},
        )
        for i in range(1025)
    ]
    # Alone on the clock (the earlier tests' tenants left their sharing windows, a few of their
    # own step periods): a tenant sharing it packs at most the pace per cycle, so its chunks may
    # spread (tests/unit/test_planner.py). A forward a second runs cycles until the clock plans
    # the whole --token-budget for this tenant alone.
    for _ in range(600):
        trainer.forward(data[:1], "cross_entropy").result()
        if pace_now(metrics_port) == TOKEN_BUDGET:
            break
        time.sleep(1.0)
    else:
        raise AssertionError("the clock never saw this tenant alone")
    result = trainer.forward_backward(data, "cross_entropy").result()
    assert len(result.loss_fn_outputs) == 1025
    cycles = {v for k, v in result.metrics.items() if k.startswith("clock_cycle:unique")}
    assert "clock_cycle:unique_1" in result.metrics  # the call really was split in two chunks
    assert len(cycles) == 1, result.metrics
    for i, out in enumerate(result.loss_fn_outputs[:3] + result.loss_fn_outputs[-2:]):
        assert out["logprobs"].to_numpy().shape == (1,), i


def _post(client: httpx.Client, path: str, **body: object) -> dict:
    r = client.post(f"/api/v1/{path}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(client: httpx.Client, request_id: str) -> httpx.Response:
    while True:
        r = client.post(
            "/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False}
        )
        assert r.status_code == 200, r.text
        if (
            r.headers["content-type"].startswith("application/json")
            and r.json().get("type") == "try_again"
        ):
            continue
        return r


def _fwdbwd(model_id: str, seq_id: int, forward_only: bool = False) -> bytes:
    tokens = np.arange(1, 33, dtype=np.int64)
    datum = wire.Datum(
        model_input=[
            wire.Chunk(
                encoded_text=wire.EncodedTextChunk(tokens=tokens[:-1].astype("<i4").tobytes())
            )
        ]
    )
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        wire.Tensor(dense=tokens[1:].astype("<i8").tobytes(), dtype=wire.DTYPE_INT64, shape=[31])
    )
    return wire.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq_id,
        data=[datum],
        loss_fn="cross_entropy",
        forward_only=forward_only,
    ).SerializeToString()


def _train_model(client: httpx.Client, session: str, n: int, replay: bool) -> float:
    """fb (sent twice when `replay`), optim, then the loss after the step."""
    future = _post(
        client,
        "create_model",
        session_id=session,
        model_seq_id=n,
        base_model="Lockstep/tiny-qwen3",
        lora_config={"rank": 4, "seed": 5},
        type="create_model",
    )
    model_id = _wait(client, future["request_id"]).json()["model_id"]
    headers = {"content-type": "application/x-protobuf"}
    first = client.post("/api/v1/forward_backward", content=_fwdbwd(model_id, 1), headers=headers)
    if replay:  # a retry after a lost response: same (model, seq_id), same payload
        again = client.post(
            "/api/v1/forward_backward", content=_fwdbwd(model_id, 1), headers=headers
        )
        assert again.json()["request_id"] == first.json()["request_id"]
    opt = _post(
        client,
        "optim_step",
        model_id=model_id,
        seq_id=2,
        type="optim_step",
        adam_params={
            "learning_rate": 0.01,
            "beta1": 0.9,
            "beta2": 0.95,
            "eps": 1e-12,
            "weight_decay": 0.0,
            "grad_clip_norm": 0.0,
        },
    )
    _wait(client, first.json()["request_id"])
    _wait(client, opt["request_id"])
    fwd = client.post(
        "/api/v1/forward_backward", content=_fwdbwd(model_id, 3, True), headers=headers
    )
    out = wire.ForwardBackwardOutput.FromString(_wait(client, fwd.json()["request_id"]).content)
    return out.metrics["loss:sum"]


def test_a_replayed_request_is_applied_once(server: Server) -> None:
    with httpx.Client(
        base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=60
    ) as client:
        session = _post(
            client,
            "create_session",
            tags=[],
            user_metadata={},
            sdk_version="test",
            type="create_session",
        )["session_id"]
        once = _train_model(client, session, 0, replay=False)
        replayed = _train_model(client, session, 1, replay=True)
        assert replayed == pytest.approx(once, rel=1e-6)
        # a different payload under a used (model, seq_id) is refused, not run
        r = client.post(
            "/api/v1/forward_backward",
            content=_fwdbwd(f"{session}:train:1", 1, forward_only=True),
            headers={"content-type": "application/x-protobuf"},
        )
        assert r.status_code == 400 and "seq_id" in r.text
