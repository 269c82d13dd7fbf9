"""The sampling lane runs generations in slices: a short sample queued while a long generation
is running is answered while the long one still runs, instead of after it. The real scheduler
in-process on a real Redis, with the REAL local sampler (tiny model)."""

from __future__ import annotations

import time
from pathlib import Path

from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.local.trainer import LocalTrainingEngine

from .inprocess import OWNER, Scheduler
from .test_cycle_commit import started, url  # noqa: F401
from .test_poison_requests import _sample_reply

WAIT_S = 600.0


def sample(sampler_id: str, seq: int, max_tokens: int) -> pb.SubmitRequest:
    params = pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=-1, has_stop=True
    )  # no EOS
    return pb.SubmitRequest(
        owner=OWNER,
        sample=pb.Sample(
            sampling_session_id=sampler_id,
            seq_id=seq,
            prompt_tokens=[5, 17, 42, 8],
            num_samples=1,
            params=params,
        ),
    )


def test_a_short_sample_is_answered_while_a_long_generation_runs(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    model_dir = ensure_default_model(tmp_path / "models")
    trainer = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME)  # the card: the tiny model's
    sched = Scheduler(
        url,
        tmp_path / "data",
        trainer=trainer,
        sampler=LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME),
    )
    started.append(sched)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    sampler = sched.stub.CreateSamplingSession(
        pb.CreateSamplingSessionRequest(
            owner=OWNER,
            session_id=session,
            sampling_session_seq_id=0,
            base_model=DEFAULT_MODEL_NAME,
        )
    ).sampler_id
    long = sched.stub.Submit(sample(sampler, 0, 4000)).request_id
    deadline = time.monotonic() + WAIT_S
    while long not in sched.lane._running:  # started: its first slice is in the engine
        assert time.monotonic() < deadline
        time.sleep(0.01)
    short = sched.stub.Submit(sample(sampler, 1, 16)).request_id
    reply = _sample_reply(sched, short, WAIT_S)
    assert reply.WhichOneof("state") == "result"
    assert len(reply.result.sample.sequences[0].tokens) // 4 == 16
    still = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=long))
    assert still.WhichOneof("state") == "try_again"  # 4000 tokens: it is far from done
    sched.stub.CancelFuture(pb.CancelFutureRequest(owner=OWNER, request_id=long))
