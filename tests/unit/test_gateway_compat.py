"""The OpenAI- and Anthropic-compatible routes' own logic against a stand-in scheduler: auth,
field validation and model resolution in each API's error shape, and the text codec (stream
pieces reassemble to the text, stop strings cut it). End to end with the official clients:
tests/integration/test_compat_api.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from lockstep.gateway.deps import owner_of
from lockstep.gateway.inference.codec import TextCodec
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.v1 import scheduler_pb2 as pb
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
    running_standin,
)

BASE = DEFAULT_MODEL_NAME
PATH = "tinker://sess-1:train:0/sampler_weights/w"
BEARER = {"Authorization": f"Bearer {TEST_API_KEY}", "X-API-Key": ""}
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[StandInScheduler, str]]:
    with running_standin() as running:
        yield running


@pytest.fixture
def sched(standin: tuple[StandInScheduler, str]) -> StandInScheduler:
    standin[0].reset()
    standin[0].replies["GetServerCapabilities"] = pb.ServerCapabilities(
        models=[pb.SupportedModel(model_name=BASE, max_context_length=4096)]
    )
    return standin[0]


@pytest.fixture
def api(
    standin: tuple[StandInScheduler, str], sched: StandInScheduler, model_dir: Path
) -> Iterator[Any]:
    with gateway_client(standin[1], tokenizer_dir=model_dir) as client:
        yield client


def test_auth_and_error_shapes(api: Any) -> None:
    body = {"model": BASE, "prompt": "hi"}
    r = api.post("/oai/api/v1/completions", json=body, headers={"X-API-Key": ""})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = api.post(
        "/anthropic/api/v1/messages",
        json={"model": BASE, "max_tokens": 1, "messages": CHAT},
        headers={"X-API-Key": "tml-wrong"},
    )
    assert r.status_code == 401
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid API key"},
    }
    for bad, param in (
        ({"temperature": 3}, "temperature"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"prompt": []}, "prompt"),
    ):
        r = api.post("/oai/api/v1/completions", json={**body, **bad}, headers=BEARER)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    r = api.post(
        "/oai/api/v1/chat/completions", json={"model": BASE, "messages": CHAT, "tools": [{}]}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    r = api.post("/anthropic/api/v1/messages", json={"model": BASE, "messages": CHAT})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    garbage = {"Content-Type": "application/json"}
    for path in ("/oai/api/v1/completions", "/anthropic/api/v1/messages"):
        r = api.post(path, content=b"`\xff\xfeS\xaa)", headers=garbage)  # not UTF-8
        assert r.status_code == 400, r.text


def test_model_resolution(api: Any, sched: StandInScheduler) -> None:
    r = api.post("/oai/api/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    assert not sched.requests("Submit")

    # A checkpoint the scheduler will not open for this key is a 404, whatever the reason.
    sched.replies["CreateSession"] = pb.CreateSessionReply(session_id="sess-9")
    sched.fail(
        "CreateSamplingSession", grpc.StatusCode.NOT_FOUND, f"checkpoint {PATH} does not exist"
    )
    r = api.post("/oai/api/v1/completions", json={"model": PATH, "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    ask = sched.last("CreateSamplingSession")
    assert (ask.owner, ask.session_id, ask.model_path) == (owner_of(TEST_API_KEY), "sess-9", PATH)
    assert "compat-api" in sched.last("CreateSession").tags

    # `<base>;<path>` must name the checkpoint's own base model.
    sched.errors.clear()
    sched.replies["CreateSamplingSession"] = pb.SamplerInfo(
        sampler_id="s:sample:1", base_model="other"
    )
    r = api.post("/oai/api/v1/completions", json={"model": f"{BASE};{PATH}", "prompt": "hi"})
    assert r.status_code == 400 and "trained on other" in r.json()["error"]["message"]

    # The sample is submitted as a Tinker Sample with the EOS always a stop token.
    sched.replies["CreateSamplingSession"] = pb.SamplerInfo(
        sampler_id="s:sample:1", base_model=BASE
    )
    sched.replies["RetrieveFuture"] = pb.FutureReply(
        error=pb.JobError(message="sampling_params: nope", category="user")
    )
    r = api.post(
        "/oai/api/v1/completions",
        json={"model": PATH, "prompt": [5, 6, 7], "max_tokens": 3, "stop": "x", "seed": -1},
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == "sampling_params: nope"
    sample = sched.last("Submit").sample
    assert (sample.sampling_session_id, list(sample.prompt_tokens)) == ("s:sample:1", [5, 6, 7])
    assert sample.params.max_tokens == 3 and list(sample.params.stop_strings) == ["x"]
    assert sample.params.has_stop and len(sample.params.stop_tokens) >= 1
    assert sample.params.seed == 2**64 - 1


def test_codec_pieces_and_stops(model_dir: Path) -> None:
    codec = TextCodec(model_dir)
    text = "Pig Latin: ananabay plitsay — ünïcødé ✓ done"
    tokens = codec.encode(text)
    assert codec.decode(tokens) == text
    pieces = codec.deltas(tokens, text)
    assert len(pieces) == len(tokens) and "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    done = codec.finish(tokens, ["plitsay", "nothing"])
    assert (done.text, done.stop_string) == ("Pig Latin: ananabay ", "plitsay")
    cut = codec.deltas(tokens, done.text)
    assert "".join(cut) == done.text
    chat = codec.encode_chat(CHAT)
    assert codec.decode(chat).endswith("assistant\n")
    assert codec.eos_ids
