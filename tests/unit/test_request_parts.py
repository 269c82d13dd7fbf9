"""A request run in parts (`PassRequest.part`) on the real local engine: the parts' results,
joined, and the gradients they leave are those of one pass (fp32 <= 1e-5), whatever else shares
the parts' calls; a failed request in parts leaves no gradient behind (`undo_parts`); an engine
that lost a request's first part refuses its later parts instead of running them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.custom_loss import graph as spec
from lockstep.engine.parts import join_results, part_request
from lockstep.engine.types import (
    AdamConfig,
    CustomLoss,
    CustomLossNode,
    Datum,
    LoraSpec,
    OptimRequest,
    PassRequest,
    PassResult,
)
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine

V = 1024  # the tiny model's vocab
SPEC = LoraSpec(rank=8, seed=5)
CUTS = [(0, 2), (2, 3), (3, 7)]  # parts of a 7-datum request: FIRST, MIDDLE, LAST


def weighted_mean(logprobs, weights):  # type: ignore[no-untyped-def]
    per = (logprobs * weights).sum() / weights.sum()
    return -per, {"custom/mean_lp:mean": per, "custom/tokens:sum": weights.sum()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LocalTrainingEngine:
    model_dir = ensure_default_model(tmp_path_factory.mktemp("models"))
    return LocalTrainingEngine(model_dir, "tiny", device="cpu")


def custom() -> CustomLoss:
    ranks = {"logprobs": 1, "weights": 1}
    handle = trace_loss(weighted_mean, ranks, "s")
    nodes = [
        CustomLossNode(d["op"], d["name"], d["target"], tuple(d["args"]), d["kwargs"])
        for d in (n.model_dump(mode="json") for n in encode_graph(handle).nodes)
    ]
    return spec.build_loss("s:loss:1", handle.name, list(ranks.items()), nodes)


def data(seed: int, n: int = 7) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(5, 40))
        inputs = {
            "target_tokens": rng.integers(0, V, t),
            "weights": rng.random(t).astype(np.float32) + 0.1,
        }
        out.append(Datum(rng.integers(0, V, t), inputs))
    return out


def request(model_id: str, loss_fn: str, forward_only: bool = False) -> PassRequest:
    loss = custom() if loss_fn == "custom" else None
    return PassRequest(f"r-{model_id}", model_id, loss_fn, {}, forward_only, data(7), loss)


def grads(engine: LocalTrainingEngine, model_id: str) -> list[torch.Tensor]:
    return [
        torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for p in engine._lora.adapter_parameters(model_id)
    ]


def assert_same_result(got: PassResult, want: PassResult) -> None:
    assert set(got.metrics) == set(want.metrics)
    for key, value in want.metrics.items():
        assert got.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
    assert len(got.outputs) == len(want.outputs)
    for a, b in zip(got.outputs, want.outputs, strict=True):
        assert set(a) == set(b)
        for key in b:
            np.testing.assert_allclose(a[key], b[key], rtol=0, atol=1e-5)


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "custom"])
def test_a_request_in_parts_equals_one_pass(engine: LocalTrainingEngine, loss_fn: str) -> None:
    """Whole for one model; in three parts for a twin, each part packed with another tenant's
    request, earlier gradients in place: same per-datum outputs, same `loss:sum` and metrics (a
    `:mean` over all datums), same gradients and the same optimizer step after them."""
    for model_id in ("whole", "parts"):
        engine.create_model(model_id, SPEC)
        engine.run_passes([request(model_id, "cross_entropy")])  # gradients accumulated before
    engine.create_model("other", LoraSpec(rank=4, seed=9))
    (want,) = engine.run_passes([request("whole", loss_fn)])
    req = request("parts", loss_fn)
    results = []
    for n, (start, stop) in enumerate(CUTS):
        other = PassRequest(f"o{n}", "other", "cross_entropy", {}, False, data(50 + n, 2))
        results.append(engine.run_passes([other, part_request(req, start, stop)])[1])
    got = join_results(results)
    assert got.request_id == req.request_id
    want.request_id = got.request_id
    assert_same_result(got, want)
    assert_close(grads(engine, "parts"), grads(engine, "whole"))
    adam = AdamConfig(learning_rate=1e-2)
    engine.optim_step([OptimRequest(m, adam) for m in ("whole", "parts")])
    assert_close(
        [p.detach() for p in engine._lora.adapter_parameters("parts")],
        [p.detach() for p in engine._lora.adapter_parameters("whole")],
    )


def test_a_forward_in_parts_equals_one_forward(engine: LocalTrainingEngine) -> None:
    engine.create_model("m", SPEC)
    req = request("m", "custom", forward_only=True)
    (want,) = engine.run_passes([req])
    got = join_results([engine.run_passes([part_request(req, a, b)])[0] for a, b in CUTS])
    assert_same_result(got, want)
    assert all(p.grad is None for p in engine._lora.adapter_parameters("m"))


def test_a_failed_request_in_parts_leaves_no_gradient_behind(engine: LocalTrainingEngine) -> None:
    engine.create_model("m", SPEC)
    engine.run_passes([request("m", "cross_entropy")])
    before = grads(engine, "m")
    req = request("m", "cross_entropy")
    for start, stop in CUTS[:2]:  # FIRST and MIDDLE ran; the LAST failed (the scheduler undoes)
        engine.run_passes([part_request(req, start, stop)])
    assert not all(torch.equal(a, b) for a, b in zip(grads(engine, "m"), before, strict=True))
    engine.undo_parts("m")
    assert all(torch.equal(a, b) for a, b in zip(grads(engine, "m"), before, strict=True))
    engine.undo_parts("m")  # nothing kept any more: nothing to do
    assert all(torch.equal(a, b) for a, b in zip(grads(engine, "m"), before, strict=True))


def test_a_later_part_without_its_first_is_refused(
    engine: LocalTrainingEngine, tmp_path: Path
) -> None:
    """An engine that lost the first part (restarted, the model reloaded) never runs the rest
    on top of state that lacks it: the request must start again from its first part."""
    engine.create_model("m", SPEC)
    req = request("m", "cross_entropy")
    engine.run_passes([part_request(req, *CUTS[0])])
    engine.save_state("m", tmp_path / "state", True)
    engine.load_state("m", tmp_path / "state", True)  # a restore: the undo point is gone
    before = grads(engine, "m")
    with pytest.raises(RuntimeError, match="first part"):
        engine.run_passes([part_request(req, *CUTS[1])])
    assert all(torch.equal(a, b) for a, b in zip(grads(engine, "m"), before, strict=True))


def test_joining_refuses_a_reduction_it_has_no_rule_for() -> None:
    outputs: list[dict[str, Any]] = [{"logprobs": np.zeros(2, np.float32)}]
    parts = [PassResult("r", outputs, {"loss:sum": 1.0, "x:max": 2.0}) for _ in range(2)]
    with pytest.raises(ValueError, match="x:max"):
        join_results(parts)
    mean = [PassResult("r", outputs * n, {"m:mean": v}) for n, v in ((1, 1.0), (3, 3.0))]
    assert join_results(mean).metrics["m:mean"] == pytest.approx(2.5)  # weighted by datums


def test_a_last_part_that_fails_alone_keeps_its_undo_point(engine: LocalTrainingEngine) -> None:
    """A part whose own data fails (a NaN loss: its weights sum to 0) gets its error in the
    call's results beside the other tenants' (per-request failures); its undo point stays, so
    undoing the request removes the earlier parts' gradients too."""
    engine.create_model("nan", SPEC)
    engine.create_model("peer", LoraSpec(rank=4, seed=9))
    before = grads(engine, "nan")
    req = request("nan", "custom")
    req.data[-1].loss_inputs["weights"] = np.zeros_like(req.data[-1].loss_inputs["weights"])
    engine.run_passes([part_request(req, *CUTS[0])])
    peer = PassRequest("p", "peer", "cross_entropy", {}, False, data(60, 2))
    ok, failed = engine.run_passes([peer, part_request(req, *CUTS[2])])
    assert ok.error is None and failed.error is not None
    engine.undo_parts("nan")
    assert all(torch.equal(a, b) for a, b in zip(grads(engine, "nan"), before, strict=True))
