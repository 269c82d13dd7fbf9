"""A NaN custom loss beside two good tenants in one cycle fails alone: the cycle makes ONE
fused pass (the good tenants are never run again one by one), every tenant is answered in that
cycle, and the good tenants' losses and gradients equal a run without the bad one. The real
scheduler in-process on a real Redis with the real local training engine (tiny model); the
engine is wrapped only to count its run_passes calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.engine.types import PassRequest, PassResult
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2 as wire
from lockstep.workers.local.trainer import LocalTrainingEngine

from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import started, url  # noqa: F401

T = 10


class CountingEngine(LocalTrainingEngine):
    """The real engine; it counts its fused passes."""

    passes = 0

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        self.passes += 1
        return super().run_passes(requests)


def weighted(logprobs, weights):  # type: ignore[no-untyped-def]
    return -(logprobs * weights).sum(), {}


def nan_loss(logprobs, weights):  # type: ignore[no-untyped-def]
    return torch.log(-(logprobs * weights).sum() - 1e9), {}  # log of a negative number


def _tensor(values: np.ndarray, dtype: int) -> wire.Tensor:
    return wire.Tensor(dtype=dtype, shape=list(values.shape), dense=values.tobytes())


def _custom(model: str, seq: int, loss_id: str) -> pb.SubmitRequest:
    tokens = np.arange(20, 20 + T + 1)
    req = wire.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="custom")
    req.loss_fn_config_v2["loss_id"].text = loss_id
    d = req.data.add()
    d.model_input.append(
        wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=tokens[:-1].astype("<i4").tobytes()))
    )
    d.loss_fn_inputs["target_tokens"].CopyFrom(_tensor(tokens[1:].astype("<i8"), wire.DTYPE_INT64))
    weights = np.linspace(0.5, 1.5, T).astype("<f4")
    d.loss_fn_inputs["weights"].CopyFrom(_tensor(weights, wire.DTYPE_FLOAT32))
    return pb.SubmitRequest(owner=OWNER, forward_backward=req)


def _loss(sched: Scheduler, session: str, seq: int, fn: object) -> str:
    handle = trace_loss(fn, {"logprobs": 1, "weights": 1}, session)  # type: ignore[arg-type]
    rid = sched.stub.CreateCustomLoss(
        pb.CreateCustomLossRequest(
            owner=OWNER,
            session_id=session,
            custom_loss_seq_id=seq,
            name=handle.name,
            inputs=[pb.CustomLossInput(name=x.name, rank=x.rank) for x in handle.inputs],
            graph_json=encode_graph(handle).model_dump_json().encode(),
        )
    ).request_id
    reply = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
    return reply.result.custom_loss.loss_id


def _model(sched: Scheduler, session: str, n: int) -> str:
    create = pb.CreateModel(
        session_id=session,
        model_seq_id=n,
        base_model=DEFAULT_MODEL_NAME,
        lora_config=pb.LoraConfig(rank=4, seed=n, train_mlp=True, train_attn=True),
    )
    sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create))
    return f"{session}:train:{n}"


def _run(sched: Scheduler, with_bad: bool) -> tuple[list[pb.FutureReply], int]:
    """Three tenants' passes and steps, then a forward of each: the cycle's replies, and the
    fused passes the cycle made."""
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    good, bad = _loss(sched, session, 0, weighted), _loss(sched, session, 1, nan_loss)
    a, b, c = (_model(sched, session, n) for n in range(3))
    sched.tick()  # the creations
    step = pb.AdamParams(learning_rate=0.5, beta1=0.0, beta2=0.0, eps=1.0)
    reqs = [_custom(a, 1, good), fb(c, 1, list(range(40, 40 + T + 1)))]
    if with_bad:
        reqs.append(_custom(b, 1, bad))
    rids = [sched.stub.Submit(r).request_id for r in reqs]
    before = sched.trainer.passes
    sched.tick()  # ONE cycle runs every pass
    passes = sched.trainer.passes - before
    replies = [
        sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        for rid in rids
    ]
    for m in (a, c):
        sched.stub.Submit(
            pb.SubmitRequest(owner=OWNER, optim_step=pb.OptimStep(model_id=m, seq_id=2, adam=step))
        )
    probe = [
        sched.stub.Submit(fb(m, 3, list(range(60, 60 + T + 1)), True)).request_id for m in (a, c)
    ]
    sched.tick()
    sched.tick()
    after = [
        sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
        for rid in probe
    ]
    return replies + after, passes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def test_a_nan_tenant_fails_alone_in_the_cycle_it_shares(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    model_dir: Path,
) -> None:
    runs = {}
    for with_bad in (False, True):
        engine = CountingEngine(model_dir, DEFAULT_MODEL_NAME)
        sched = Scheduler(url, tmp_path / str(with_bad), trainer=engine)
        started.append(sched)
        runs[with_bad] = _run(sched, with_bad)
    (alone, _), (shared, passes) = runs[False], runs[True]
    assert passes == 1  # one fused pass: nobody ran again one by one
    good_a, good_c, bad, *after = shared
    assert bad.WhichOneof("state") == "error" and bad.error.category == "user"
    assert "nan_loss" in bad.error.message and "nan" in bad.error.message.lower()
    cycles = {r.result.forward_backward.metrics["clock_cycle:unique"] for r in (good_a, good_c)}
    assert len(cycles) == 1
    want_a, want_c, *want_after = alone
    for got, want in [(good_a, want_a), (good_c, want_c), *zip(after, want_after, strict=True)]:
        g, w = got.result.forward_backward, want.result.forward_backward
        assert g.metrics["loss:sum"] == pytest.approx(w.metrics["loss:sum"], abs=1e-5)
        for x, y in zip(g.loss_fn_outputs, w.loss_fn_outputs, strict=True):
            np.testing.assert_allclose(
                np.frombuffer(x.fields["logprobs"].data, "<f4"),
                np.frombuffer(y.fields["logprobs"].data, "<f4"),
                atol=1e-5,
            )
