"""A refused training request keeps its seq_id, whatever refused it, and never hangs its model.

The SDK numbers a model's requests 1, 2, 3, ... and moves on after any answer, a 4xx included;
the scheduler runs them strictly in order. So for every sequenced route x encoding x refusal
stage, on a server with and without a keys file: send the refused request (seq S), then the
model's next requests pipelined (forward_backward S+1 and optim_step S+2, both submitted before
either is awaited) and require both to finish within WAIT_S. An unauthenticated request is not
the owner's: it holds nothing, so the owner's own S and S+1 run.

Stages: auth (a key the server does not know), size (a body declared larger than
--max-body-bytes, of which the server reads only the head), decode (truncated JSON or
protobuf), schema (the request model: a field of the wrong type or range), check (a gateway
rule past the schema), scheduler (a rule only the scheduler's state can judge). A route/stage
pair is listed where the server has such a rule for that route: optim_step and the two plain
saves have no rule the scheduler alone applies.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPConnection
from typing import Any
from urllib.parse import urlsplit

import anthropic
import httpx
import numpy as np
import openai
import pytest
import tinker
from tinker import types

from lockstep.gateway.body import PREFIX_BYTES
from lockstep.gateway.ops import registry
from lockstep.wire.v1 import tinker_pb2 as wire

from .conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KEY = "tml-refused-owner"
BAD_KEY = {"plain": "sk-no-tml-prefix", "keyed": "tml-not-in-the-keys-file"}
KEYS = f'[[key]]\nname = "owner"\nkey = "{KEY}"\n'
TOO_LARGE = 2**28 + 1  # declared past the default --max-body-bytes (256 MiB); never sent
HEAD = PREFIX_BYTES  # what is sent of it: what the server reads of a body it refuses
WAIT_S = 10.0  # a stuck model fails its case after this instead of hanging the suite
PROTO = "application/x-protobuf"
BASE = "Lockstep/tiny-qwen3"


@dataclass
class Box:
    http: httpx.Client
    server: Server
    session: str
    models: Iterator[int]


@pytest.fixture(scope="module")
def boxes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Box]]:
    """The suite's shared server (no keys file) and one with a keys file, started side by side
    with it when this module runs alone."""
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS)
    with ThreadPoolExecutor(1) as pool:
        keyed = pool.submit(
            start_server, tmp_path_factory.mktemp("keyed") / "data", "--keys-file", str(keys)
        )
        servers = {"plain": request.getfixturevalue("server"), "keyed": keyed.result()}
    out: dict[str, Box] = {}
    try:
        for name, srv in servers.items():
            http = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": KEY}, timeout=WAIT_S)
            session = _ok(http.post("/api/v1/create_session", json={"type": "create_session"}))
            out[name] = Box(http, srv, session["session_id"], itertools.count())
        yield out
    finally:
        for box in out.values():
            box.http.close()
        assert stop_server(servers["keyed"]) == 0, servers["keyed"].log()[-3000:]


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _wait(http: httpx.Client, request_id: str) -> None:
    """Until the request has a result; a model stuck behind a seq_id fails here, fast."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            answer = http.post(
                "/api/v1/retrieve_future",
                json={"request_id": request_id},
                timeout=max(0.5, deadline - time.monotonic()),
            )
        except httpx.TimeoutException:
            break
        assert answer.status_code == 200, answer.text
        if answer.headers["content-type"].startswith(PROTO):
            return
        body = answer.json()
        assert "error" not in body, body
        if body.get("type") != "try_again":
            return
    raise AssertionError(f"request {request_id} got no result in {WAIT_S}s: its model is stuck")


def _new_model(box: Box) -> str:
    created = _ok(
        box.http.post(
            "/api/v1/create_model",
            json={
                "session_id": box.session,
                "model_seq_id": next(box.models),
                "base_model": BASE,
                "lora_config": {"rank": 4},
            },
        )
    )
    model_id: str = created["model_id"]  # exists once submitted: no need to wait for it
    return model_id


# ---------------------------------------------------------------- request bodies
def _fb_input(dtype: str = "int64", shape: int = 4, token: int = 3) -> dict[str, Any]:
    return {
        "data": [
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, token, 4]}]},
                "loss_fn_inputs": {
                    "target_tokens": {"data": [2, 3, 4, 5], "dtype": dtype, "shape": [shape]}
                },
            }
        ],
        "loss_fn": "cross_entropy",
    }


def _fb_proto(
    model_id: str,
    seq: int,
    forward_only: bool,
    dtype: wire.DType = wire.DTYPE_INT64,
    token: int = 3,
) -> bytes:
    datum = wire.Datum(
        model_input=[
            wire.Chunk(
                encoded_text=wire.EncodedTextChunk(
                    tokens=np.asarray([1, 2, token, 4], "<i4").tobytes()
                )
            )
        ]
    )
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        wire.Tensor(dense=np.asarray([2, 3, 4, 5], "<i8").tobytes(), dtype=dtype, shape=[4])
    )
    return wire.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=seq,
        data=[datum],
        loss_fn="cross_entropy",
        forward_only=forward_only,
    ).SerializeToString()


ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12}
_FB_KEY = {"forward_backward": "forward_backward_input", "forward": "forward_input"}
PATH = {
    "forward": "forward_backward",  # the SDK's forward is a forward_backward with forward_only
    "forward_backward": "forward_backward",
    "optim_step": "optim_step",
    "save_weights": "save_weights",
    "save_weights_for_sampler": "save_weights_for_sampler",
    "save_weights_external": "save_weights_external",
    "load_weights": "load_weights",
}


def _json_body(route: str, stage: str, model_id: str, seq: int) -> dict[str, Any]:
    """The route's JSON body, broken the way `stage` needs (auth, size, decode: a good one)."""
    ids = {"model_id": model_id, "seq_id": seq}
    name = f"ck-{seq}"
    if route in _FB_KEY:
        fb = {
            "schema": _fb_input(dtype="complex256"),
            "check": _fb_input(shape=7),
            "scheduler": _fb_input(token=10**8),
        }.get(stage, _fb_input())
        return {**ids, _FB_KEY[route]: fb}
    if route == "optim_step":
        if stage == "check":
            return {**ids, "optimizer_params": {"type": "dimuon", "learning_rate": 0.1}}
        lr = -1.0 if stage == "schema" else 1e-3
        return {**ids, "adam_params": {**ADAM, "learning_rate": lr}}
    if route == "load_weights":
        path = {"check": "s3://bucket/key"}.get(stage, f"tinker://{model_id}/weights/never-saved")
        optimizer = "maybe" if stage == "schema" else False
        return {**ids, "path": path, "optimizer": optimizer}
    body: dict[str, Any] = {**ids, "path": "../x" if stage == "check" else name}
    if stage == "schema":
        body["ttl_seconds"] = 0
    if route == "save_weights_for_sampler" and stage == "check":
        body.update(path=name, kind="bogus")
    if route == "save_weights_external" and stage == "scheduler":
        body["age_encryption_recipients"] = ["not-an-age-recipient"]
    return body


def _refused_request(
    route: str, encoding: str, stage: str, model_id: str, seq: int
) -> tuple[str, bytes, dict[str, str]]:
    path = f"/api/v1/{PATH[route]}"
    if encoding == "proto":
        headers = {"content-type": PROTO}
        forward_only = route == "forward"
        dtype = wire.DTYPE_BFLOAT16 if stage == "schema" else wire.DTYPE_INT64
        token = 10**8 if stage == "scheduler" else 3
        content = _fb_proto(model_id, seq, forward_only, dtype, token)
        if stage == "decode":
            content = content[:-7]  # cut inside its last field: not a whole message
        elif stage == "size":  # the head of a valid message too large to read
            big = wire.ForwardBackwardRequest.FromString(content)
            big.data[0].model_input[0].encoded_text.tokens = b"\1\0\0\0" * HEAD
            content = big.SerializeToString()[:HEAD]
        return path, content, headers
    headers = {"content-type": "application/json"}
    body = _json_body(route, stage, model_id, seq)
    if stage == "size":
        body["padding"] = "x" * HEAD
    content = json.dumps(body).encode()[: HEAD if stage == "size" else None]
    if stage == "decode":
        content = content[:-1]  # no closing brace: not JSON
    return path, content, headers


# What each stage answers; None: any 4xx the SDK does not retry.
STATUS = {"auth": 401, "size": 413, "decode": 400, "schema": 400, "check": 400}
JSON_STAGES = ("auth", "size", "decode", "schema", "check")
CASES = [
    *[
        (route, enc, stage)
        for route in ("forward_backward", "forward")
        for enc, stages in (
            ("json", (*JSON_STAGES, "scheduler")),
            ("proto", ("auth", "size", "decode", "schema", "scheduler")),
        )
        for stage in stages
    ],
    *[("optim_step", "json", stage) for stage in JSON_STAGES],
    *[("save_weights", "json", stage) for stage in JSON_STAGES],
    *[("save_weights_for_sampler", "json", stage) for stage in JSON_STAGES],
    *[("save_weights_external", "json", stage) for stage in (*JSON_STAGES, "scheduler")],
    *[("load_weights", "json", stage) for stage in (*JSON_STAGES, "scheduler")],
]


def _post(box: Box, path: str, content: bytes, headers: dict[str, str], stage: str) -> Any:
    """The refused request; for `size`, the head of a body declared too large, as a client
    uploading one sends it (the server answers before the rest would come)."""
    if stage != "size":
        return box.http.post(path, content=content, headers=headers)
    url = urlsplit(box.server.base_url)
    conn = HTTPConnection(url.hostname or "", url.port, timeout=WAIT_S)
    try:
        conn.putrequest("POST", path)
        for name, value in {"X-API-Key": KEY, **headers, "Content-Length": str(TOO_LARGE)}.items():
            conn.putheader(name, value)
        conn.endheaders(content)
        answer = conn.getresponse()
        return httpx.Response(answer.status, content=answer.read())
    finally:
        conn.close()


def test_every_sequenced_route_is_in_the_table() -> None:
    assert {f"/api/v1/{PATH[route]}" for route, _, _ in CASES} == registry.sequenced_paths()


def _pipelined_next(http: httpx.Client, model_id: str, seq: int) -> None:
    """forward_backward `seq` and optim_step `seq + 1`, both sent before either is awaited."""
    fb = http.post(
        "/api/v1/forward_backward",
        content=_fb_proto(model_id, seq, forward_only=False),
        headers={"content-type": PROTO},
    )
    step = http.post(
        "/api/v1/optim_step",
        json={"model_id": model_id, "seq_id": seq + 1, "adam_params": ADAM},
    )
    for answer in (fb, step):
        _wait(http, _ok(answer)["request_id"])


@pytest.mark.parametrize("keys", ["plain", "keyed"])
@pytest.mark.parametrize(("route", "encoding", "stage"), CASES, ids=["-".join(c) for c in CASES])
def test_a_refused_request_never_stalls_its_model(
    boxes: dict[str, Box], keys: str, route: str, encoding: str, stage: str
) -> None:
    box = boxes[keys]
    model_id = _new_model(box)
    path, content, headers = _refused_request(route, encoding, stage, model_id, 1)
    if stage == "auth":
        headers = {**headers, "X-API-Key": BAD_KEY[keys]}
    answer = _post(box, path, content, headers, stage)
    assert 400 <= answer.status_code < 500, answer.text
    assert answer.status_code not in (408, 409, 429), "the SDK would retry a permanent error"
    assert answer.status_code == STATUS.get(stage, answer.status_code), answer.text
    assert answer.json()["detail"], answer.text
    # an unauthenticated request is not the owner's: the owner's own seq 1 comes next
    _pipelined_next(box.http, model_id, 1 if stage == "auth" else 2)


def test_sdk_negative_learning_rate_then_pipelined_steps(boxes: dict[str, Box]) -> None:
    """The reported case: through the SDK, with a keys file, an optim_step the gateway refuses
    does not hold up the same client's next forward_backward + optim_step."""
    client = tinker.ServiceClient(base_url=boxes["keyed"].server.base_url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4, 5], dtype="int64")},
    )
    with pytest.raises(tinker.BadRequestError, match="learning_rate"):
        trainer.optim_step(types.AdamParams(learning_rate=-1.0)).result(timeout=WAIT_S)
    fb = trainer.forward_backward([datum], "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-3))
    assert fb.result(timeout=WAIT_S).metrics["loss:sum"] > 0
    step.result(timeout=WAIT_S)


@pytest.fixture(scope="module")
def sampler_path(boxes: dict[str, Box]) -> str:
    client = tinker.ServiceClient(base_url=boxes["keyed"].server.base_url, api_key=KEY)
    trainer = client.create_lora_training_client(base_model=BASE, rank=4).result()
    path: str = trainer.save_weights_for_sampler("compat").result().path
    return path


def test_keys_file_keys_work_on_the_compatible_routes(
    boxes: dict[str, Box], sampler_path: str
) -> None:
    base = boxes["keyed"].server.base_url
    oai = openai.OpenAI(base_url=base + "/oai/api/v1", api_key=KEY, max_retries=0)
    out = oai.completions.create(model=sampler_path, prompt="hello", max_tokens=2)
    assert out.choices[0].text is not None
    claude = anthropic.Anthropic(base_url=base + "/anthropic/api", api_key=KEY, max_retries=0)
    message = claude.messages.create(
        model=sampler_path, max_tokens=2, messages=[{"role": "user", "content": "hello"}]
    )
    assert message.content is not None
    for bad in (
        lambda: openai.OpenAI(
            base_url=base + "/oai/api/v1", api_key=BAD_KEY["keyed"], max_retries=0
        ).completions.create(model=sampler_path, prompt="hello", max_tokens=2),
        lambda: anthropic.Anthropic(
            base_url=base + "/anthropic/api", api_key=BAD_KEY["keyed"], max_retries=0
        ).messages.create(
            model=sampler_path, max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        ),
    ):
        with pytest.raises((openai.AuthenticationError, anthropic.AuthenticationError)):
            bad()
