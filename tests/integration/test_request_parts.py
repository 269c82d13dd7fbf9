"""A forward_backward larger than its tenant's pace runs in parts across cycles while other
tenants share the clock: the light tenants get cycles between its parts, nothing else of its
model runs between them, it is answered once, with its last part, and its numbers are those of
one pass. A failed part fails the request and leaves no gradient behind; an engine death or a
scheduler restart between parts runs the request again from its first part, applied once.

The real scheduler in-process on a real Redis; the FAKE arithmetic engine (exact sums) for the
wiring and the faults, the REAL local engine (tiny model) for the numbers. The clock's pace is
pinned (`pin_pace`) so which cycle runs which part does not depend on the machine's speed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.scheduler.cycle.pace import MIN_CYCLE_TOKENS
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2 as wire
from lockstep.workers.local.trainer import LocalTrainingEngine

from .arithmetic_engine import features, initial_weights, read_weights
from .inprocess import OWNER, Scheduler, fb
from .test_cycle_commit import LR, _create, _result, _save, _start, _step, started, url  # noqa: F401

ROWS = 8  # datums of the heavy request, ~200 tokens each: about three times the pace
LIGHT = [3, 9, 27, 17, 51]


def pin_pace(sched: Scheduler, tokens: int = MIN_CYCLE_TOKENS) -> None:
    """The clock packs `tokens` per cycle while tenants share it, whatever the timings."""
    pace = sched.clock.pace
    pace.seconds_per_token = sched.clock.config.cycle_target_s / tokens
    pace.observe = lambda tokens, seconds: None  # type: ignore[method-assign]


def rows(seed: int, n: int = ROWS, length: int = 200, vocab: int = 64) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, length).tolist() for _ in range(n)]


def heavy_fb(
    model_id: str, seq: int, data: list[list[int]], loss: str = "cross_entropy", loss_id: str = ""
) -> pb.SubmitRequest:
    req = wire.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn=loss)
    if loss_id:
        req.loss_fn_config_v2["loss_id"].text = loss_id
    for tokens in data:
        d = req.data.add()
        inputs = np.asarray(tokens[:-1], "<i4").tobytes()
        d.model_input.append(wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=inputs)))
        for key, value, dtype in (
            ("target_tokens", np.asarray(tokens[1:], "<i8"), wire.DTYPE_INT64),
            ("weights", np.linspace(0.5, 1.5, len(tokens) - 1).astype("<f4"), wire.DTYPE_FLOAT32),
        ):
            d.loss_fn_inputs[key].CopyFrom(
                wire.Tensor(dtype=dtype, shape=[len(tokens) - 1], dense=value.tobytes())
            )
    return pb.SubmitRequest(owner=OWNER, forward_backward=req)


def pending(sched: Scheduler, rid: str) -> bool:
    reply = sched.stub.RetrieveFuture(pb.RetrieveFutureRequest(owner=OWNER, request_id=rid))
    return reply.WhichOneof("state") == "try_again"


def cycle_of(reply: pb.FutureReply) -> int:
    return int(reply.result.forward_backward.metrics["clock_cycle:unique"])


def test_a_big_request_runs_in_parts_and_light_tenants_get_cycles_between_them(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    sched = _start(started, url, tmp_path)
    pin_pace(sched)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    heavy, light = _create(sched, session, 0, seed=3), _create(sched, session, 1, seed=4)
    data = rows(0)
    big = sched.stub.Submit(heavy_fb(heavy, 1, data)).request_id
    after = [sched.stub.Submit(req).request_id for req in (_step(heavy, 2), fb(heavy, 3, LIGHT))]
    light_cycles = []
    seq = 1
    while pending(sched, big):
        ids = [
            sched.stub.Submit(r).request_id for r in (fb(light, seq, LIGHT), _step(light, seq + 1))
        ]
        seq += 2
        sched.tick()  # one cycle: the light step and one part of the big request
        replies = [_result(sched, rid, cycles=1) for rid in ids]
        assert [r.WhichOneof("state") for r in replies] == ["result"] * 2
        light_cycles.append(cycle_of(replies[0]))
        assert pending(sched, after[1])  # nothing of the heavy model runs between its parts
        assert len(light_cycles) < 10
    answer = _result(sched, big)
    assert answer.WhichOneof("state") == "result"
    # Light steps ran in three or more cycles before the big request was answered (its parts).
    assert len(light_cycles) >= 3 and cycle_of(answer) == light_cycles[-1]
    out = answer.result.forward_backward
    (record,) = out.loss_fn_outputs
    offsets = np.frombuffer(record.fields["logprobs"].offsets, "<i8")
    assert (np.diff(offsets) // 4).tolist() == [len(d) - 1 for d in data]  # every datum, in order
    w0 = initial_weights(3)
    assert out.metrics["loss:sum"] == pytest.approx(float(w0 @ features(data)), rel=1e-12)
    assert [_result(sched, rid).WhichOneof("state") for rid in after] == ["result"] * 2
    ok = sched.stub.Submit(_save(heavy, 4, "after")).request_id
    assert _result(sched, ok).WhichOneof("state") == "result"
    saved = read_weights(tmp_path / "checkpoints" / heavy / "weights" / "after")
    np.testing.assert_allclose(saved, w0 - LR * features(data), rtol=0, atol=1e-12)


def test_a_failed_part_fails_its_request_and_leaves_no_gradient(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    sched = _start(started, url, tmp_path)
    pin_pace(sched)
    sched.trainer.fail_token = 63
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    heavy, light = _create(sched, session, 0, seed=3), _create(sched, session, 1, seed=4)
    data = rows(1, vocab=60)
    data[-1][5] = 63  # the last part fails, after the earlier parts accumulated their gradients
    rids = [
        sched.stub.Submit(req).request_id
        for req in (
            fb(heavy, 1, LIGHT),
            heavy_fb(heavy, 2, data),
            _step(heavy, 3),
            _save(heavy, 4, "after"),
        )
    ]
    seq = 1
    while pending(sched, rids[1]):
        sched.stub.Submit(fb(light, seq, LIGHT))
        seq += 1
        sched.tick()
        assert seq < 12
    failed = _result(sched, rids[1])
    assert failed.WhichOneof("state") == "error" and failed.error.category == "user"
    assert "failing token" in failed.error.message
    assert seq > 3  # it failed in a later part
    assert [_result(sched, r).WhichOneof("state") for r in rids[2:]] == ["result"] * 2
    saved = read_weights(tmp_path / "checkpoints" / heavy / "weights" / "after")
    expected = initial_weights(3) - LR * features([LIGHT])  # only the request before it
    np.testing.assert_allclose(saved, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fault", ["engine death", "scheduler restart"])
def test_a_request_interrupted_between_parts_runs_again_from_its_first_part(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    fault: str,
) -> None:
    sched = _start(started, url, tmp_path)
    pin_pace(sched)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    heavy, light = _create(sched, session, 0, seed=3), _create(sched, session, 1, seed=4)
    data = rows(2)
    rids = [
        sched.stub.Submit(r).request_id
        for r in (heavy_fb(heavy, 1, data), _step(heavy, 2), _save(heavy, 3, "after"))
    ]
    sched.stub.Submit(fb(light, 1, LIGHT))
    sched.tick()  # the first part
    assert pending(sched, rids[0])
    if fault == "engine death":
        sched.trainer.die_at_next_pass = True
    else:
        sched.close()
        started.remove(sched)
        sched = _start(started, url, tmp_path)  # nothing resident, no parts remembered
        pin_pace(sched)
    restarts = sched.trainer.restarts
    for seq in range(2, 12):
        sched.stub.Submit(fb(light, seq, LIGHT))
        sched.tick()
        if not pending(sched, rids[0]):
            break
    assert sched.trainer.restarts == restarts + (fault == "engine death")
    replies = [_result(sched, rid) for rid in rids]
    assert [r.WhichOneof("state") for r in replies] == ["result"] * 3
    w0 = initial_weights(3)
    loss = replies[0].result.forward_backward.metrics["loss:sum"]
    assert loss == pytest.approx(float(w0 @ features(data)), rel=1e-12)
    saved = read_weights(tmp_path / "checkpoints" / heavy / "weights" / "after")
    np.testing.assert_allclose(saved, w0 - LR * features(data), rtol=0, atol=1e-12)  # once


def weighted_mean(logprobs, weights):  # type: ignore[no-untyped-def]
    per = (logprobs * weights).sum() / weights.sum()
    return -per, {"custom/mean_lp:mean": per, "custom/tokens:sum": weights.sum()}


def test_a_request_in_parts_answers_what_one_pass_does(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The real engine: a built-in and a custom loss request, each in parts for one tenant and
    whole for its twin (same seed): per-datum outputs, loss:sum and the custom metrics (a `:mean`
    over all datums) agree within fp32 rounding, and so do the adapters after a step."""
    model_dir = ensure_default_model(tmp_path / "models")
    engine = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    sched = Scheduler(url, tmp_path / "data", trainer=engine)
    started.append(sched)
    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    ranks = {"logprobs": 1, "weights": 1}
    graph = encode_graph(trace_loss(weighted_mean, ranks, session))
    created = sched.stub.CreateCustomLoss(
        pb.CreateCustomLossRequest(
            owner=OWNER,
            session_id=session,
            custom_loss_seq_id=1,
            name="weighted_mean",
            inputs=[pb.CustomLossInput(name=k, rank=v) for k, v in ranks.items()],
            graph_json=graph.model_dump_json().encode(),
        )
    ).request_id
    loss_id = _result(sched, created).result.custom_loss.loss_id
    models = {}
    for n, name in enumerate(("parts", "whole", "light")):
        create = pb.CreateModel(
            session_id=session,
            model_seq_id=n,
            base_model=DEFAULT_MODEL_NAME,
            lora_config=pb.LoraConfig(rank=4, seed=7 if name != "light" else 8, train_mlp=True),
        )
        rid = sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create)).request_id
        assert _result(sched, rid).WhichOneof("state") == "result"
        models[name] = f"{session}:train:{n}"
    data = rows(3, n=6, length=180, vocab=1000)
    requests = [("cross_entropy", ""), ("custom", loss_id)]

    def run(model: str, split: bool) -> list[pb.FutureReply]:
        if split:
            pin_pace(sched)
        else:  # no pace: everything whole (as a tenant alone)
            sched.clock.pace.target_s = 0.0
        ids = [
            sched.stub.Submit(heavy_fb(model, seq, data, loss, lid)).request_id
            for seq, (loss, lid) in enumerate(requests, start=1)
        ]
        ids.append(sched.stub.Submit(_step(model, len(requests) + 1)).request_id)
        light = 1
        cycles = 0
        while pending(sched, ids[-1]):
            if split:  # a light neighbour keeps the clock shared
                sched.stub.Submit(fb(models["light"], light, LIGHT))
                light += 1
            sched.tick()
            cycles += 1
            assert cycles < 30
        assert cycles >= 5 if split else cycles == 1
        return [_result(sched, rid) for rid in ids]

    got, want = run(models["parts"], True), run(models["whole"], False)
    for a, b in zip(got[:-1], want[:-1], strict=True):
        assert a.WhichOneof("state") == b.WhichOneof("state") == "result", (a, b)
        ma, mb = a.result.forward_backward.metrics, b.result.forward_backward.metrics
        assert set(ma) == set(mb)
        for key in mb:
            if key != "clock_cycle:unique":
                assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-5), key
        (ra,), (rb,) = (
            a.result.forward_backward.loss_fn_outputs,
            b.result.forward_backward.loss_fn_outputs,
        )
        assert set(ra.fields) == set(rb.fields) and ra.num_datums == rb.num_datums == len(data)
        for key, want_field in rb.fields.items():
            assert ra.fields[key].offsets == want_field.offsets, key
            np.testing.assert_allclose(
                np.frombuffer(ra.fields[key].data, "<f4"),
                np.frombuffer(want_field.data, "<f4"),
                rtol=0,
                atol=1e-5,
                err_msg=key,
            )
    for model in models.values():
        engine.export_adapter(model, tmp_path / "export" / model)
    from safetensors.numpy import load_file

    a = load_file(str(tmp_path / "export" / models["parts"] / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "export" / models["whole"] / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-5, err_msg=key)
