"""Sampling routes (create_sampling_session, samplers/{id}, asample) against a stand-in
scheduler with canned replies."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from lockstep.gateway.deps import owner_of
from lockstep.v1 import scheduler_pb2 as pb
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
)

OWNER = owner_of(TEST_API_KEY)
MODEL = "sess-1:train:0"


@pytest.fixture
def api(standin: tuple[StandInScheduler, str], sched: StandInScheduler) -> Iterator[Any]:
    with gateway_client(standin[1]) as client:
        yield client


def test_sampling_sessions(api: Any, sched: StandInScheduler) -> None:
    sched.replies["CreateSamplingSession"] = pb.SamplerInfo(sampler_id="sess-1:sample:0")
    path = f"tinker://{MODEL}/sampler_weights/step-0"
    body = {"session_id": "sess-1", "sampling_session_seq_id": 0, "model_path": path}
    r = api.post("/api/v1/create_sampling_session", json=body)
    assert r.json() == {"type": "create_sampling_session", "sampling_session_id": "sess-1:sample:0"}
    req = sched.last("CreateSamplingSession")
    assert (req.owner, req.model_path, req.HasField("base_model")) == (OWNER, path, False)
    bad_id = api.post(
        "/api/v1/create_sampling_session",
        json={"session_id": "bad id", "sampling_session_seq_id": 1, "model_path": path},
    )
    assert bad_id.json()["detail"].startswith("session_id: 'bad id' is not a valid id")

    sched.replies["GetSampler"] = pb.SamplerInfo(sampler_id="sess-1:sample:1", base_model="B")
    assert api.get("/api/v1/samplers/sess-1:sample:1").json() == {
        "sampler_id": "sess-1:sample:1",
        "base_model": "B",
        "model_path": None,
    }


def _sample(**over: Any) -> dict[str, Any]:
    body = {
        "num_samples": 2,
        "prompt": {
            "chunks": [
                {"tokens": [1, 2], "type": "encoded_text"},
                {"tokens": [3], "type": "encoded_text"},
            ]
        },
        "sampling_params": {
            "max_tokens": 3,
            "seed": 5,
            "stop": ["\n"],
            "temperature": 0.7,
            "top_k": -1,
            "top_p": 1.0,
        },
        "sampling_session_id": "sess-1:sample:0",
        "seq_id": 7000000000,
        "prompt_logprobs": True,
        "topk_prompt_logprobs": 2,
        "topk_sample_logprobs": 0,
        "prompt_alt_tokens_k": 0,
        "record_stability_info": False,
        "type": "sample",
    }
    body.update(over)
    return body


def test_asample(api: Any, sched: StandInScheduler) -> None:
    sched.replies["Submit"] = pb.SubmitReply(request_id="req-s", sample_sequence_ids=["a", "b"])
    r = api.post("/api/v1/asample", json=_sample())
    assert r.json() == {"request_id": "req-s", "sample_sequence_ids": ["a", "b"]}
    op = sched.last("Submit").sample
    assert (op.sampling_session_id, op.seq_id, list(op.prompt_tokens), op.num_samples) == (
        "sess-1:sample:0",
        7000000000,
        [1, 2, 3],
        2,
    )
    assert (op.prompt_logprobs, op.topk_prompt_logprobs, op.HasField("prompt_logprobs_last_n")) == (
        True,
        2,
        False,
    )
    p = op.params
    assert (p.max_tokens, p.seed, p.top_k, p.has_stop, list(p.stop_strings)) == (
        3,
        5,
        -1,
        True,
        ["\n"],
    )
    assert p.temperature == pytest.approx(0.7)

    sched.replies["Submit"] = pb.SubmitReply(request_id="req-t")
    r = api.post("/api/v1/asample", json=_sample(sampling_params={"stop": [7, 8], "seed": -1}))
    assert r.json()["sample_sequence_ids"] == ["req-t:seq:0", "req-t:seq:1"]
    p = sched.last("Submit").sample.params
    assert (list(p.stop_tokens), p.seed, p.HasField("max_tokens")) == ([7, 8], 2**64 - 1, False)
    api.post("/api/v1/asample", json=_sample(sampling_params={"stop": []}))
    p = sched.last("Submit").sample.params
    assert (p.has_stop, len(p.stop_strings), len(p.stop_tokens)) == (True, 0, 0)
    api.post("/api/v1/asample", json=_sample(sampling_params={}))
    assert not sched.last("Submit").sample.params.has_stop


@pytest.mark.parametrize(
    "over, detail",
    [
        (
            {"sampling_params": {"max_tokens": 2**31}},
            "sampling_params.max_tokens: must be <= 2147483647",
        ),
        (
            {"prompt": {"chunks": [{"type": "image", "data": "!!", "format": "png"}]}},
            "prompt.chunks[0].data: not valid base64",
        ),
        ({"sampling_session_id": None}, "sampling_session_id: field required"),
        ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k: not supported"),
    ],
)
def test_asample_rejects(api: Any, over: dict[str, Any], detail: str) -> None:
    """Only the address and what the contract cannot carry: the rest of a sample's rules are
    the scheduler's (tests/unit/test_request_rules.py)."""
    r = api.post("/api/v1/asample", json=_sample(**over))
    assert r.status_code == 400 and r.json()["detail"].startswith(detail), r.json()


def test_a_prompt_with_images_goes_as_its_chunks(api: Any, sched: StandInScheduler) -> None:
    """How many tokens an image is, the scheduler says (it judges images): the gateway only
    converts the chunks."""
    sched.replies["Submit"] = pb.SubmitReply(request_id="req-i")
    chunks = [
        {"type": "encoded_text", "tokens": [1, 2]},
        {"type": "image", "data": "iVBORw==", "format": "png", "expected_tokens": 4},
        {"type": "encoded_text", "tokens": [3]},
    ]
    r = api.post("/api/v1/asample", json=_sample(prompt={"chunks": chunks}))
    assert r.status_code == 200, r.json()
    sample = sched.last("Submit").sample
    assert list(sample.prompt_tokens) == []
    kinds = [c.WhichOneof("chunk") for c in sample.prompt_chunks]
    assert kinds == ["encoded_text", "image", "encoded_text"]
    image = sample.prompt_chunks[1].image
    assert (image.data, image.format, image.expected_tokens) == (b"\x89PNG", "png", 4)


def test_asample_backpressure_is_429(api: Any, sched: StandInScheduler) -> None:
    sched.fail("Submit", grpc.StatusCode.RESOURCE_EXHAUSTED, "sampler queue full")
    r = api.post("/api/v1/asample", json=_sample())
    assert (r.status_code, r.json()) == (429, {"detail": "sampler queue full"})
    assert r.headers["retry-after"] == "1"


def test_asample_accepts_record_stability_info(api: Any, sched: StandInScheduler) -> None:
    """The cookbook samples with record_stability_info=True; it is accepted (and records
    nothing: stable_reinforce, the only loss that reads it, is refused with a clear 400)."""
    sched.replies["Submit"] = pb.SubmitReply(request_id="req-r", sample_sequence_ids=["x", "y"])
    r = api.post("/api/v1/asample", json=_sample(record_stability_info=True))
    assert r.status_code == 200 and r.json()["sample_sequence_ids"] == ["x", "y"], r.json()
