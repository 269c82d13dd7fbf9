"""What a refused training request names: (model_id, seq_id) read from a body that may be cut
off, malformed or over the size limit, and which routes take a place in a model's seq order."""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any

import pytest

from lockstep.gateway.app import create_app
from lockstep.gateway.body import BodyLimitMiddleware, request_body
from lockstep.gateway.ops import registry
from lockstep.gateway.refusals import read_ids
from lockstep.gateway.settings import GatewaySettings
from lockstep.wire.v1 import tinker_pb2 as wire

JSON = "application/json"
PROTO = "application/x-protobuf"
GOOD = {"model_id": "s:train:0", "seq_id": 7, "adam_params": {"learning_rate": -1}}


def _fb(seq_id: int = 7) -> bytes:
    datum = wire.Datum(model_input=[wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=b"1234"))])
    datum.loss_fn_inputs["target_tokens"].CopyFrom(wire.Tensor(dense=b"\0" * 8, shape=[1]))
    return wire.ForwardBackwardRequest(
        model_id="s:train:0", seq_id=seq_id, data=[datum], loss_fn="cross_entropy"
    ).SerializeToString()


@pytest.mark.parametrize(
    "body",
    [
        json.dumps(GOOD),
        json.dumps(GOOD)[:-1],  # no closing brace
        json.dumps(GOOD)[:-12],  # cut inside adam_params: what came before stands
        json.dumps({**GOOD, "padding": "x" * 100})[:60],  # the first bytes of a 413
        ' {\n"model_id" : "s:train:0" ,"seq_id":7, "dtype": complex256}',  # bad after the ids
        '{"data": [{"seq_id": 3}], "loss_fn_config": {"seq_id": 4}, "model_id": "s:train:0", '
        '"seq_id": 7',  # nested seq_ids name nothing
    ],
)
def test_json_ids_survive_a_broken_body(body: str) -> None:
    assert read_ids(body.encode(), JSON) == ("s:train:0", 7)


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not json",
        "[1, 2]",
        '{"model_id": "s:train:0"}',
        '{"model_id": "s:train:0", "seq_id": 0}',
        '{"model_id": "s:train:0", "seq_id": -3}',
        '{"model_id": "s:train:0", "seq_id": true}',
        '{"model_id": "s:train:0", "seq_id": 7.5}',
        '{"model_id": "s:train:0", "seq_id": 99999999999}',
        '{"model_id": 5, "seq_id": 7}',
        '{"seq_id": 7, "model_id": "s:tr',  # the model_id is cut off
    ],
)
def test_json_without_both_ids_names_nothing(body: str) -> None:
    assert read_ids(body.encode(), JSON) is None


@pytest.mark.parametrize("cut", [0, 7, 30])
def test_protobuf_ids_survive_a_cut_message(cut: int) -> None:
    body = _fb()
    assert read_ids(body[: len(body) - cut], PROTO) == ("s:train:0", 7)
    assert read_ids(body + b"\xff\xff", PROTO) == ("s:train:0", 7)  # garbage after the ids


@pytest.mark.parametrize(
    "body", [b"", b"\xff\xfe not protobuf", _fb()[:5], _fb(seq_id=0), _fb(seq_id=-2)]
)
def test_protobuf_without_both_ids_names_nothing(body: bytes) -> None:
    assert read_ids(body, PROTO) is None


def test_every_route_with_a_model_seq_id_is_sequenced() -> None:
    """A new training route with a seq_id must be listed, or its refusals would stall models."""
    doc = create_app(GatewaySettings(scheduler_address="127.0.0.1:1")).openapi()
    schemas = doc["components"]["schemas"]
    found = set()
    for path, item in doc["paths"].items():
        content = item.get("post", {}).get("requestBody", {}).get("content", {})
        for media in content.values():
            ref = media.get("schema", {}).get("$ref", "")
            fields = schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {})
            if {"model_id", "seq_id"} <= set(fields):
                found.add(path)
    assert found == registry.sequenced_paths()


@pytest.mark.parametrize("declared", [None, 10**9])
def test_a_body_over_the_limit_keeps_its_head_for_the_report(declared: int | None) -> None:
    """Chunked, or declared too large: the 413 comes after the first bytes, which name the ids."""
    head = b'{"model_id": "s:train:0", "seq_id": 7, "padding": "'
    incoming = [head, b"x" * 150, b"x" * 150, b'"}']
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": incoming.pop(0), "more_body": bool(incoming)}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("a body over the limit never reaches the app")

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope: dict[str, Any] = {"type": "http", "headers": headers}
    asyncio.run(BodyLimitMiddleware(app, max_body_bytes=200)(scope, receive, send))
    assert sent[0]["status"] == 413
    assert read_ids(request_body(scope), JSON) == ("s:train:0", 7)
    assert incoming, "it stopped reading at the limit"
