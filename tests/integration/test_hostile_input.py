"""Malformed and hostile requests: each gets a 4xx naming the problem, and nothing is stuck.

Every refused training request still uses its seq_id, so the model's next request (with the next
seq_id, as the SDK sends it) runs; the last check trains the same model after all the abuse.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest

from lockstep.wire.v1 import tinker_pb2 as wire

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e
PROTO = {"content-type": "application/x-protobuf"}


@dataclass
class Ctx:
    http: httpx.Client
    session: str
    model_id: str
    sampler: str
    seq: Iterator[int]  # the model's training seq_ids (the SDK's counter)
    sample_seq: Iterator[int]  # the sampler's own request counter

    def next_seq(self) -> int:
        return next(self.seq)


def _tokens(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def _tensor(
    values: list[Any],
    dtype: int = wire.DTYPE_INT64,
    shape: list[int] | None = None,
    raw: bytes | None = None,
) -> wire.Tensor:
    np_dtype = {wire.DTYPE_INT64: "<i8", wire.DTYPE_FLOAT32: "<f4"}.get(dtype, "<f4")
    data = raw if raw is not None else np.asarray(values, dtype=np_dtype).tobytes()
    return wire.Tensor(dense=data, dtype=dtype, shape=shape if shape is not None else [len(values)])


def fb(
    ctx: Ctx,
    tokens: list[int] | None = None,
    loss_fn: str = "cross_entropy",
    inputs: dict[str, wire.Tensor] | None = None,
    seq: int | None = None,
    chunk: wire.Chunk | None = None,
    data: list[wire.Datum] | None = None,
) -> bytes:
    tokens = tokens if tokens is not None else [1, 2, 3, 4]
    datum = wire.Datum(
        model_input=[
            chunk or wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=_tokens(tokens)))
        ]
    )
    for k, v in (
        inputs if inputs is not None else {"target_tokens": _tensor([2, 3, 4, 5][: len(tokens)])}
    ).items():
        datum.loss_fn_inputs[k].CopyFrom(v)
    return wire.ForwardBackwardRequest(
        model_id=ctx.model_id,
        seq_id=ctx.next_seq() if seq is None else seq,
        data=[datum] if data is None else data,
        loss_fn=loss_fn,
    ).SerializeToString()


def adam(**overrides: Any) -> dict[str, Any]:
    return {
        "learning_rate": 1e-3,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
        **overrides,
    }


def post_fb(ctx: Ctx, body: bytes, headers: dict[str, str] = PROTO) -> httpx.Response:
    return ctx.http.post("/api/v1/forward_backward", content=body, headers=headers)


def post(ctx: Ctx, path: str, body: dict[str, Any]) -> httpx.Response:
    return ctx.http.post(f"/api/v1/{path}", json=body)


def optim(ctx: Ctx, **params: Any) -> httpx.Response:
    return post(
        ctx,
        "optim_step",
        {
            "model_id": ctx.model_id,
            "seq_id": ctx.next_seq(),
            "type": "optim_step",
            "adam_params": adam(**params),
        },
    )


def save(ctx: Ctx, name: str) -> httpx.Response:
    return post(
        ctx,
        "save_weights",
        {"model_id": ctx.model_id, "seq_id": ctx.next_seq(), "path": name, "type": "save_weights"},
    )


def load(ctx: Ctx, path: str) -> httpx.Response:
    return post(
        ctx,
        "load_weights",
        {
            "model_id": ctx.model_id,
            "seq_id": ctx.next_seq(),
            "path": path,
            "optimizer": False,
            "type": "load_weights",
        },
    )


def sample(ctx: Ctx, tokens: list[int] | None = None, **params: Any) -> httpx.Response:
    sp = {"max_tokens": 4, "temperature": 1.0, "top_k": -1, "top_p": 1.0, **params}
    return post(
        ctx,
        "asample",
        {
            "sampling_session_id": params.pop("sampler", ctx.sampler),
            "seq_id": next(ctx.sample_seq),
            "num_samples": sp.pop("num_samples", 1),
            "sampling_params": sp,
            "prompt": {
                "chunks": [
                    {"type": "encoded_text", "tokens": tokens if tokens is not None else [1, 2, 3]}
                ]
            },
            "type": "sample",
        },
    )


F32 = wire.DTYPE_FLOAT32
CASES: list[tuple[str, Callable[[Ctx], httpx.Response], str]] = [
    # forward_backward (protobuf body)
    ("token id >= vocab", lambda c: post_fb(c, fb(c, tokens=[1, 2, 10**8, 4])), "token"),
    ("negative token id", lambda c: post_fb(c, fb(c, tokens=[1, -5, 3, 4])), "token"),
    (
        "target beyond vocab",
        lambda c: post_fb(c, fb(c, inputs={"target_tokens": _tensor([2, 3, 4, 10**9])})),
        "target_tokens",
    ),
    (
        "length mismatch",
        lambda c: post_fb(c, fb(c, inputs={"target_tokens": _tensor([2, 3])})),
        "target_tokens",
    ),
    (
        "weights wrong length",
        lambda c: post_fb(
            c,
            fb(
                c,
                inputs={
                    "target_tokens": _tensor([2, 3, 4, 5]),
                    "weights": _tensor([1.0, 1.0], F32),
                },
            ),
        ),
        "weights",
    ),
    (
        "NaN weight",
        lambda c: post_fb(
            c,
            fb(
                c,
                inputs={
                    "target_tokens": _tensor([2, 3, 4, 5]),
                    "weights": _tensor([1.0, math.nan, 1.0, 1.0], F32),
                },
            ),
        ),
        "weights",
    ),
    (
        "bfloat16 tensor",
        lambda c: post_fb(
            c,
            fb(
                c,
                inputs={"target_tokens": _tensor([2, 3, 4, 5], wire.DTYPE_BFLOAT16, raw=b"\0" * 8)},
            ),
        ),
        "target_tokens",
    ),
    (
        "shape disagrees with bytes",
        lambda c: post_fb(c, fb(c, inputs={"target_tokens": _tensor([2, 3, 4, 5], shape=[7])})),
        "target_tokens",
    ),
    ("unknown loss", lambda c: post_fb(c, fb(c, loss_fn="telepathy")), "loss_fn"),
    (
        "missing advantages",
        lambda c: post_fb(
            c,
            fb(
                c,
                loss_fn="importance_sampling",
                inputs={
                    "target_tokens": _tensor([2, 3, 4, 5]),
                    "logprobs": _tensor([-1.0] * 4, F32),
                },
            ),
        ),
        "advantages",
    ),
    ("no datums", lambda c: post_fb(c, fb(c, data=[])), "data"),
    ("empty model input", lambda c: post_fb(c, fb(c, tokens=[], inputs={})), "model_input"),
    (
        "image chunk",
        lambda c: post_fb(
            c, fb(c, chunk=wire.Chunk(image=wire.ImageChunk(data=b"\x89PNG", format="png")))
        ),
        "image",
    ),
    (
        "too long for the context",
        lambda c: post_fb(
            c, fb(c, tokens=[1] * 5000, inputs={"target_tokens": _tensor([1] * 5000)})
        ),
        "context",
    ),
    ("seq_id 0", lambda c: post_fb(c, fb(c, seq=0)), "seq_id"),
    # a body too broken to name its model cannot hold a seq_id (the SDK never sends one); a cut
    # one still names its ids, so it takes a seq_id far ahead that nothing waits for
    ("truncated protobuf", lambda c: post_fb(c, fb(c, seq=10**6)[:-7]), "body"),
    ("garbage body", lambda c: post_fb(c, b"\xff\xfe not protobuf"), "body"),
    (
        "bad zstd body",
        lambda c: post_fb(c, b"not zstd", {**PROTO, "content-encoding": "zstd"}),
        "zstd",
    ),
    # optim_step
    (
        "learning rate NaN",
        lambda c: c.http.post(
            "/api/v1/optim_step",
            headers={"content-type": "application/json"},
            content=(
                f'{{"model_id": "{c.model_id}", "seq_id": {c.next_seq()}, "type": '
                '"optim_step", "adam_params": {"learning_rate": NaN}}'
            ),
        ),
        "learning_rate",
    ),
    ("learning rate negative", lambda c: optim(c, learning_rate=-1.0), "learning_rate"),
    ("beta1 >= 1", lambda c: optim(c, beta1=1.5), "beta1"),
    ("learning rate as text", lambda c: optim(c, learning_rate="fast"), "learning_rate"),
    (
        "other optimizer",
        lambda c: post(
            c,
            "optim_step",
            {
                "model_id": c.model_id,
                "seq_id": c.next_seq(),
                "type": "optim_step",
                "optimizer_params": {"type": "dimuon", "learning_rate": 0.1},
            },
        ),
        "dimuon",
    ),
    (
        "unknown model",
        lambda c: post(
            c,
            "optim_step",
            {
                "model_id": "sess-nope:train:0",
                "seq_id": 1,
                "type": "optim_step",
                "adam_params": adam(),
            },
        ),
        "sess-nope",
    ),
    # checkpoints
    ("../ in a name", lambda c: save(c, "../../etc"), "path"),
    ("absolute name", lambda c: save(c, "/etc/passwd"), "path"),
    ("slash in a name", lambda c: save(c, "a/b"), "path"),
    ("load a traversal path", lambda c: load(c, "tinker://x:train:0/weights/../../x"), "path"),
    (
        "load a missing checkpoint",
        lambda c: load(c, f"tinker://{c.model_id}/weights/never-saved"),
        "never-saved",
    ),
    (
        "load sampler weights as state",
        lambda c: load(c, f"tinker://{c.model_id}/sampler_weights/x"),
        "path",
    ),
    ("not a tinker path", lambda c: load(c, "s3://bucket/key"), "path"),
    # sampling
    ("unknown sampler", lambda c: sample(c, sampler="sess-x:sample:9"), "sampl"),
    ("prompt token >= vocab", lambda c: sample(c, tokens=[1, 10**7]), "prompt"),
    ("empty prompt", lambda c: sample(c, tokens=[]), "prompt"),
    ("zero samples", lambda c: sample(c, num_samples=0), "num_samples"),
    ("zero max_tokens", lambda c: sample(c, max_tokens=0), "max_tokens"),
    ("max_tokens past the context", lambda c: sample(c, max_tokens=10**6), "max_tokens"),
    ("negative temperature", lambda c: sample(c, temperature=-1.0), "temperature"),
    # futures, sessions, auth
    (
        "unknown future",
        lambda c: post(c, "retrieve_future", {"request_id": "req-missing"}),
        "req-missing",
    ),
    (
        "unknown session",
        lambda c: post(
            c,
            "create_model",
            {
                "session_id": "sess-missing",
                "model_seq_id": 0,
                "base_model": "Lockstep/tiny-qwen3",
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        ),
        "sess-missing",
    ),
    (
        "unknown base model",
        lambda c: post(
            c,
            "create_model",
            {
                "session_id": c.session,
                "model_seq_id": 50,
                "base_model": "no/such-model",
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        ),
        "base_model",
    ),
    (
        "rank 0",
        lambda c: post(
            c,
            "create_model",
            {
                "session_id": c.session,
                "model_seq_id": 51,
                "base_model": "Lockstep/tiny-qwen3",
                "lora_config": {"rank": 0},
                "type": "create_model",
            },
        ),
        "rank",
    ),
    # found by tests/integration/test_fuzz_openapi.py (was a 500)
    (
        "non-ASCII download signature",
        lambda c: c.http.get("/api/v1/checkpoint_files/o/r/weights/n/f?expires=1&sig=%C3%BE"),
        "signature",
    ),
    (
        "no API key",
        lambda c: httpx.post(
            str(c.http.base_url) + "/api/v1/create_session", json={"type": "create_session"}
        ),
        "API key",
    ),
    (
        "key without tml- prefix",
        lambda c: httpx.post(
            str(c.http.base_url) + "/api/v1/create_session",
            json={"type": "create_session"},
            headers={"X-API-Key": "sk-nope"},
        ),
        "tml-",
    ),
]


@pytest.fixture(scope="module")
def ctx(server: Server) -> Iterator[Ctx]:
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}, timeout=60) as http:
        session = http.post(
            "/api/v1/create_session",
            json={"tags": [], "user_metadata": {}, "sdk_version": "t", "type": "create_session"},
        ).json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "Lockstep/tiny-qwen3",
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        ).json()
        sampler = http.post(
            "/api/v1/create_sampling_session",
            json={
                "session_id": session,
                "sampling_session_seq_id": 0,
                "base_model": "Lockstep/tiny-qwen3",
                "type": "create_sampling_session",
            },
        ).json()["sampling_session_id"]
        yield Ctx(
            http, session, created["model_id"], sampler, itertools.count(1), itertools.count(0)
        )


def test_there_are_at_least_thirty_cases() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize(("name", "call", "mention"), CASES, ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_clear_4xx(
    ctx: Ctx, name: str, call: Callable[[Ctx], httpx.Response], mention: str
) -> None:
    response = call(ctx)
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
    assert response.status_code not in (408, 409, 429), "the SDK would retry a permanent error"
    detail = response.json()["detail"]
    assert mention.lower() in detail.lower(), (name, detail)
    assert ctx.http.get("/api/v1/healthz").status_code == 200


def test_the_model_still_trains_after_all_of_that(ctx: Ctx) -> None:
    request = ctx.http.post("/api/v1/forward_backward", content=fb(ctx), headers=PROTO)
    assert request.status_code == 200, request.text
    rid = request.json()["request_id"]
    for _ in range(3):  # each poll is held up to 25 s: three unanswered polls mean stuck
        answer = ctx.http.post(
            "/api/v1/retrieve_future", json={"request_id": rid, "allow_metadata_only": False}
        )
        assert answer.status_code == 200, answer.text
        if answer.headers["content-type"].startswith("application/x-protobuf"):
            out = wire.ForwardBackwardOutput.FromString(answer.content)
            assert out.metrics["loss:sum"] > 0
            return
        assert answer.json().get("type") == "try_again", answer.text
    raise AssertionError("the model's queue is stuck behind a refused seq_id")
