"""A request that kills the training engine (a fused pass) or the sampling engine (a sample
batch) every time is found and refused with a bounded number of engine restarts, and every other
request completes with the numbers of an undisturbed run. The real scheduler in-process on a real
Redis; the FAKE arithmetic engines die whenever a pass or a prompt holds the poison token (fault
injection)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

from lockstep.scheduler.cycle.poison import PoisonHunt
from lockstep.v1 import scheduler_pb2 as pb

from .arithmetic_engine import features, initial_weights
from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import LR, _create, _result, _start, _step, started, url  # noqa: F401

POISON = 61
GOOD = [[3, 9, 27, 17, 51], [5, 10, 20, 40], [7, 14, 28, 56, 12, 24], [2, 4, 8, 16, 32]]


@pytest.mark.parametrize("tenants,poisoned", [(1, [0]), (4, [2]), (6, [5]), (4, [0, 3])])
def test_a_poison_request_is_refused_and_the_others_finish(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    tenants: int,
    poisoned: list[int],
) -> None:
    sched = _start(started, url, tmp_path)
    sched.trainer.poison_token = POISON
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    models = [_create(sched, session, i, seed=10 + i) for i in range(tenants)]
    rows = [([POISON] if i in poisoned else []) + GOOD[i % len(GOOD)] for i in range(tenants)]
    rids = [
        [sched.stub.Submit(req).request_id for req in (fb(m, 1, r), _step(m, 2), fb(m, 3, r, True))]
        for m, r in zip(models, rows, strict=True)
    ]
    restarts_before = sched.trainer.restarts
    replies = [[_result(sched, rid, cycles=30) for rid in ids] for ids in rids]

    incidents = 2 * len(poisoned)  # a poisoned tenant's two passes (seq 1 and 3) each kill it
    bound = incidents * (2 + math.ceil(math.log2(tenants)))
    assert sched.trainer.restarts - restarts_before <= bound
    for i, (fb1, step, fb3) in enumerate(replies):
        if i in poisoned:
            for reply in (fb1, fb3):
                assert reply.WhichOneof("state") == "error"
                assert reply.error.category == "user"
                assert "crashed the training engine" in reply.error.message
                assert "it is refused" in reply.error.message
            continue
        assert [r.WhichOneof("state") for r in (fb1, step, fb3)] == ["result"] * 3, i
        f = features([rows[i]])
        w1 = initial_weights(10 + i) - LR * f  # exactly one pass and one step applied
        loss = fb3.result.forward_backward.metrics["loss:sum"]
        assert loss == pytest.approx(float(w1 @ f), rel=1e-12)
    # The server keeps serving the refused tenant's model.
    m = models[poisoned[0]]
    ok = sched.stub.Submit(fb(m, 4, GOOD[0], True)).request_id
    assert _result(sched, ok).WhichOneof("state") == "result"


def test_the_hunt_halves_the_suspects_and_forgets_a_one_off_death() -> None:
    hunt = PoisonHunt()
    ids = [f"r{i}" for i in range(8)]
    assert hunt.calls(ids, ids) == [ids]
    hunt.died(ids, "signal 9")  # first death: the same work again
    assert hunt.calls(ids, ids) == [ids]
    hunt.died(ids, "signal 9")  # second: everyone suspect, cut in halves
    assert hunt.calls(ids, ids) == [ids[:4], ids[4:]]
    hunt.survived(ids[:4])
    hunt.died(ids[4:], "signal 9")
    assert hunt.calls(ids, ids) == [ids[4:6], ids[6:], ids[:4]]
    hunt.died(ids[4:6], "signal 9")
    assert hunt.calls(ids, ids) == [["r4"], ["r5"], ids[:4] + ids[6:]]
    hunt.died(["r4"], "signal 9")
    assert "crashed the training engine" in (hunt.verdict("r4") or "")
    assert hunt.verdict("r5") is None and hunt.calls(ids, ids) == [ids]
    assert hunt.verdict("r4") is not None  # still refused if that cycle runs again
    one_off = PoisonHunt()
    one_off.died(ids, "signal 9")
    one_off.survived(ids)
    one_off.died(ids, "signal 9")  # a first death again, not a second
    assert one_off.calls(ids, ids) == [ids]


def _sample_reply(sched: Scheduler, rid: str, wait_s: float = 60.0) -> pb.FutureReply:
    """The sample's answer; samples run on the sampling lane (its own task), not on ticks."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        reply = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        if reply.WhichOneof("state") != "try_again":
            return reply
        time.sleep(0.02)
    raise AssertionError(f"sample {rid} still pending after {wait_s} s")


@pytest.mark.parametrize("samples,poisoned", [(1, [0]), (5, [3]), (8, [0, 6])])
def test_a_poison_sample_is_refused_and_the_others_answered(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    samples: int,
    poisoned: list[int],
) -> None:
    """The sampling lane hunts the sample that kills the sampling engine the same way: bounded
    restarts, that sample refused (category user), every other sample answered correctly."""
    sched = _start(started, url, tmp_path)
    sched.sampler.poison_token = POISON
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    sampler = sched.stub.CreateSamplingSession(
        pb.CreateSamplingSessionRequest(
            owner=OWNER, session_id=session, sampling_session_seq_id=0, base_model="Fake/arithmetic"
        )
    ).sampler_id
    prompts = [([POISON] if i in poisoned else []) + GOOD[i % len(GOOD)] for i in range(samples)]
    params = pb.SamplingParams(max_tokens=1, top_p=1.0, top_k=-1)
    # Queued together (the lane is held) so they meet the engine in one batch.
    sched.run(sched.lane._engine_lock.acquire())
    rids = [
        sched.stub.Submit(
            pb.SubmitRequest(
                owner=OWNER,
                sample=pb.Sample(
                    sampling_session_id=sampler,
                    seq_id=i,
                    prompt_tokens=p,
                    num_samples=1,
                    params=params,
                ),
            )
        ).request_id
        for i, p in enumerate(prompts)
    ]
    sched.loop.call_soon_threadsafe(sched.lane._engine_lock.release)
    replies = [_sample_reply(sched, rid) for rid in rids]

    bound = len(poisoned) * (2 + math.ceil(math.log2(samples)))
    assert 2 <= sched.sampler.restarts <= bound
    for i, reply in enumerate(replies):
        if i in poisoned:
            assert reply.WhichOneof("state") == "error", i
            assert reply.error.category == "user"
            assert "this sample crashed the sampling engine" in reply.error.message
            assert "it is refused" in reply.error.message
            continue
        assert reply.WhichOneof("state") == "result", (i, reply)
        tokens = np.frombuffer(reply.result.sample.sequences[0].tokens, "<i4")
        assert tokens.tolist() == [sum(prompts[i])]  # the fake sampler's answer: the prompt's sum
    # The sampler keeps serving afterwards.
    again = sched.stub.Submit(
        pb.SubmitRequest(
            owner=OWNER,
            sample=pb.Sample(
                sampling_session_id=sampler,
                seq_id=samples,
                prompt_tokens=GOOD[0],
                num_samples=1,
                params=params,
            ),
        )
    ).request_id
    assert _sample_reply(sched, again).WhichOneof("state") == "result"
