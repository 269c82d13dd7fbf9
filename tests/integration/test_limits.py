"""Limits (lockstep/config/limits.py): one real `lockstep serve` started with tiny limits; each is
enforced with a clear 4xx naming it, and the SDK chunks its batches below them on its own."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import httpx
import numpy as np
import pytest
import redis
import tinker
from tinker import types

from lockstep.scheduler.state import keys
from lockstep.wire.v1 import tinker_pb2 as wire

from .conftest import Server, start_server, stop_server

pytestmark = pytest.mark.e2e
PROTO = {"content-type": "application/x-protobuf"}
BASE = "Lockstep/tiny-qwen3"
MAX_TOKENS, MAX_DATUMS, PER_KEY, POOL, TTL = 16, 4, 2, 7, 3
SNAPSHOT_S = 1  # a step's result keeps no TTL until a snapshot holds the step
CYCLE_CAP = 8  # --max-tokens-per-cycle-per-key: one 2-datum batch of 4 tokens
KEYS = [f"tml-limits-{i}" for i in range(11)]
OWNER, SDK_KEY, RACER, *SPARE = KEYS


@dataclass
class Tenant:
    http: httpx.Client
    session: str
    model_id: str
    seq: Iterator[int]


def create_session(http: httpx.Client) -> str:
    return str(
        http.post(
            "/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"},
        ).json()["session_id"]
    )


def create_model(http: httpx.Client, session: str, n: int) -> httpx.Response:
    return http.post(
        "/api/v1/create_model",
        json={
            "session_id": session,
            "model_seq_id": n,
            "base_model": BASE,
            "lora_config": {"rank": 4},
            "type": "create_model",
        },
    )


def wait(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(5):
        answer = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if answer.status_code != 200 or answer.json().get("type") != "try_again":
            return answer
    raise AssertionError(f"{request_id} never finished")


def fb(t: Tenant, n_tokens: int = 4, n_datums: int = 1, seq: int | None = None) -> bytes:
    tokens = np.arange(1, n_tokens + 1, dtype="<i4")
    datum = wire.Datum(
        model_input=[wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=tokens.tobytes()))]
    )
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        wire.Tensor(
            dense=(tokens + 1).astype("<i8").tobytes(), dtype=wire.DTYPE_INT64, shape=[n_tokens]
        )
    )
    return wire.ForwardBackwardRequest(
        model_id=t.model_id,
        seq_id=next(t.seq) if seq is None else seq,
        data=[datum] * n_datums,
        loss_fn="cross_entropy",
    ).SerializeToString()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    keys = [arg for key in KEYS for arg in ("--api-key", key)]
    srv = start_server(
        tmp_path_factory.mktemp("limits") / "data",
        *keys,
        "--max-body-mb",
        "0.25",
        "--max-tokens-per-datum",
        str(MAX_TOKENS),
        "--max-datums-per-request",
        str(MAX_DATUMS),
        "--max-tenants",
        str(POOL),
        "--max-tenants-per-key",
        str(PER_KEY),
        "--future-ttl",
        str(TTL),
        "--snapshot-interval",
        str(SNAPSHOT_S),
        "--max-tokens-per-cycle-per-key",
        str(CYCLE_CAP),
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def tenant(limited: Server) -> Iterator[Tenant]:
    with httpx.Client(base_url=limited.base_url, headers={"X-API-Key": OWNER}, timeout=60) as http:
        session = create_session(http)
        created = create_model(http, session, 0).json()
        assert wait(http, created["request_id"]).status_code == 200
        yield Tenant(http, session, created["model_id"], itertools.count(1))


def refused(response: httpx.Response, status: int, *mentions: str) -> None:
    assert response.status_code == status, response.text
    for mention in mentions:
        assert mention in response.json()["detail"], response.text


def test_body_size(tenant: Tenant) -> None:
    # Never parsed, so it holds no seq_id: a far-away one keeps the model's sequence intact.
    body = fb(tenant, seq=10**6) + b"\0" * (300 * 1024)
    refused(
        tenant.http.post("/api/v1/forward_backward", content=body, headers=PROTO),
        413,
        "body",
        str(256 * 1024),
    )


def test_tokens_per_datum(tenant: Tenant) -> None:
    ok = tenant.http.post("/api/v1/forward_backward", content=fb(tenant, MAX_TOKENS), headers=PROTO)
    assert ok.status_code == 200, ok.text
    refused(
        tenant.http.post(
            "/api/v1/forward_backward", content=fb(tenant, MAX_TOKENS + 1), headers=PROTO
        ),
        400,
        "data[0].model_input",
        "max_tokens_per_datum",
    )


def test_datums_per_request(tenant: Tenant) -> None:
    refused(
        tenant.http.post(
            "/api/v1/forward_backward", content=fb(tenant, n_datums=MAX_DATUMS + 1), headers=PROTO
        ),
        400,
        "data",
        "max_datums_per_request",
    )


def test_the_sdk_chunks_below_the_limits(limited: Server) -> None:
    """The client config tells the SDK the datum limit: ten datums go out as 4 + 4 + 2."""
    client = tinker.ServiceClient(base_url=limited.base_url, api_key=SDK_KEY)
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, i + 4]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[2, 3, 4, i + 5], dtype="int64", shape=[4])
            },
        )
        for i in range(10)
    ]
    out = trainer.forward_backward(batch, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == 10
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_future_ttl(limited: Server, tenant: Tenant) -> None:
    """A result stays retrievable for --future-ttl after it was recorded, then answers 404.
    Read from Redis's own clock, not slept out: the expiry Redis holds for the job is never
    earlier than TTL after the step was submitted, and once Redis's time passed it the future
    is gone."""
    store = redis.Redis.from_url((limited.data_dir / "redis" / "url").read_text())
    submitted_ms = _redis_ms(store)
    step = tenant.http.post(
        "/api/v1/optim_step",
        json={
            "model_id": tenant.model_id,
            "seq_id": next(tenant.seq),
            "type": "optim_step",
            "adam_params": {"learning_rate": 1e-3},
        },
    )
    rid = step.json()["request_id"]
    assert wait(tenant.http, rid).status_code == 200
    # A step's result keeps no expiry until a snapshot holds it (it is in the replay log,
    # --snapshot-interval): wait for the expiry to be set, then read it.
    deadline = time.monotonic() + 120
    while (expires_ms := store.pexpiretime(keys.job(rid))) < 0:
        assert time.monotonic() < deadline, "the result never got its expiry"
        time.sleep(0.2)
    assert expires_ms >= submitted_ms + TTL * 1000, "expires before its TTL"
    while _redis_ms(store) <= expires_ms:
        time.sleep(0.2)
    refused(tenant.http.post("/api/v1/retrieve_future", json={"request_id": rid}), 404, rid)


def _redis_ms(store: redis.Redis) -> int:
    seconds, micros = store.time()
    return int(seconds * 1000 + micros // 1000)


def test_concurrent_creations_stop_at_the_key_quota_and_share_its_cycle_cap(
    limited: Server,
) -> None:
    """Eight creations of one key at once: exactly PER_KEY succeed (the check and the insert
    are one Redis transaction), the rest get a 400 naming the quota. The two runs' batches
    (CYCLE_CAP tokens each) then never share a clock cycle: the key's cap allows one."""
    client = tinker.ServiceClient(base_url=limited.base_url, api_key=RACER)

    def created(future: Any) -> tinker.TrainingClient | Exception:
        try:
            return cast(tinker.TrainingClient, future.result())
        except tinker.BadRequestError as exc:
            return exc

    # The SDK returns each creation's future at once: all eight are in flight together.
    pending = [client.create_lora_training_client(base_model=BASE, rank=4) for _ in range(8)]
    results = [created(f) for f in pending]
    trainers = [r for r in results if isinstance(r, tinker.TrainingClient)]
    errors = [r for r in results if not isinstance(r, tinker.TrainingClient)]
    assert len(trainers) == PER_KEY and len(errors) == 8 - PER_KEY, results
    assert all("max_tenants_per_key" in str(e) for e in errors), errors
    assert _runs(limited.base_url, RACER) == PER_KEY

    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3, i + 4]),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[2, 3, 4, i + 5], dtype="int64", shape=[4])
            },
        )
        for i in range(CYCLE_CAP // 4)
    ]
    futures = [t.forward_backward(batch, "cross_entropy") for t in trainers]
    cycles = {f.result().metrics["clock_cycle:unique"] for f in futures}
    assert len(cycles) == PER_KEY, cycles


def _runs(base_url: str, key: str) -> int:
    listing = httpx.get(
        f"{base_url}/api/v1/training_runs", params={"limit": 100}, headers={"X-API-Key": key}
    ).json()
    return len(listing["training_runs"])


def test_tenants_per_key_and_per_pool(limited: Server, tenant: Tenant) -> None:
    total = sum(_runs(limited.base_url, key) for key in KEYS)
    assert total <= POOL - PER_KEY
    spare = iter(SPARE)
    with httpx.Client(
        base_url=limited.base_url, headers={"X-API-Key": next(spare)}, timeout=60
    ) as http:
        session = create_session(http)
        for n in range(PER_KEY):
            assert create_model(http, session, n).status_code == 200
        refused(create_model(http, session, PER_KEY), 400, "max_tenants_per_key")
        total += PER_KEY
    while True:  # one run per key until the pool is full
        with httpx.Client(
            base_url=limited.base_url, headers={"X-API-Key": next(spare)}, timeout=60
        ) as http:
            answer = create_model(http, create_session(http), 0)
            if total == POOL:
                refused(answer, 400, "max_tenants")
                assert "max_tenants_per_key" not in answer.text
                return
            assert answer.status_code == 200, answer.text
            total += 1
