"""A sample's prompt is decoded once: at its admission, where it is judged, and the sampling
lane runs that decoded request as it is. A sample the lane does not hold decoded (a restarted
scheduler's, or one past the bound) is decoded from its stored payload, with the same answer.
The real scheduler in-process on a real Redis, with the FAKE arithmetic engines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lockstep.scheduler import translate
from lockstep.v1 import scheduler_pb2 as pb

from .inprocess import OWNER, Scheduler
from .test_cycle_commit import started, url  # noqa: F401
from .test_poison_requests import _sample_reply

PROMPT = [3, 9, 27]


def _sample(sampler: str, seq: int) -> pb.SubmitRequest:
    params = pb.SamplingParams(max_tokens=1, top_p=1.0, top_k=-1)
    sample = pb.Sample(
        sampling_session_id=sampler, seq_id=seq, prompt_tokens=PROMPT, num_samples=1, params=params
    )
    return pb.SubmitRequest(owner=OWNER, sample=sample)


def test_a_samples_prompt_is_decoded_once(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched = Scheduler(url, tmp_path)
    started.append(sched)
    decoded: list[str] = []
    real = translate.sample_request

    def counted(request_id: str, *args: object, **kwargs: object) -> object:
        decoded.append(request_id)
        return real(request_id, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(translate, "sample_request", counted)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    sampler = sched.stub.CreateSamplingSession(
        pb.CreateSamplingSessionRequest(
            owner=OWNER, session_id=session, sampling_session_seq_id=0, base_model="Fake/arithmetic"
        )
    ).sampler_id

    held = sched.stub.Submit(_sample(sampler, 0)).request_id
    answers = [_sample_reply(sched, held)]
    assert decoded == [""]  # at admission only (its id is given once it is claimed)

    # Not held (what a restarted scheduler finds queued): decoded from the payload, once.
    monkeypatch.setattr(sched.lane.decoded, "keep", lambda request_id, req: None)
    again = sched.stub.Submit(_sample(sampler, 1)).request_id
    answers.append(_sample_reply(sched, again))
    assert decoded == ["", "", again]
    for reply in answers:
        tokens = np.frombuffer(reply.result.sample.sequences[0].tokens, "<i4")
        assert tokens.tolist() == [sum(PROMPT)]  # the fake sampler's answer: the prompt's sum
