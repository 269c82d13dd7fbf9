"""A request that fails on its own data fails alone inside ONE run_passes call: the real local
engine (tiny model) runs a NaN custom loss, a custom loss whose op fails, and good tenants (a
custom and a built-in loss) in one call; the bad requests get their error, leave no gradient
behind, and every other request's results and gradients equal a call without them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.custom_loss import graph
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
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine

MODELS = ("good", "bad", "broken", "builtin")
# A huge eps makes one AdamW step ~ lr * g / eps: the new weights carry the gradient itself.
STEP = AdamConfig(learning_rate=100.0, beta1=0.0, beta2=0.0, eps=100.0)


def weighted(logprobs, weights):  # type: ignore[no-untyped-def]
    loss = -(logprobs * weights).sum()
    return loss, {"custom/nll:sum": loss}


def nan_when_light(logprobs, weights):  # type: ignore[no-untyped-def]
    # log of a negative number for a datum whose weights sum to less than 1.5: NaN
    return -(logprobs * weights).sum() + torch.log(weights.sum() - 1.5), {}


def fails_on_odd_lengths(logprobs, weights):  # type: ignore[no-untyped-def]
    return (logprobs.reshape(2, -1) * weights.reshape(2, -1)).sum(), {}


def _loss(fn: Any) -> CustomLoss:
    ranks = {"logprobs": 1, "weights": 1}
    handle = trace_loss(fn, ranks, "s")
    nodes = [
        CustomLossNode(d["op"], d["name"], d["target"], tuple(d["args"]), d["kwargs"])
        for d in (n.model_dump(mode="json") for n in encode_graph(handle).nodes)
    ]
    return graph.build_loss(f"s:loss:{fn.__name__}", handle.name, list(ranks.items()), nodes)


def _datum(seed: int, length: int, weight: float = 1.0) -> Datum:
    tokens = np.random.default_rng(seed).integers(0, 1000, length + 1)
    return Datum(
        tokens[:-1],
        {"target_tokens": tokens[1:], "weights": np.full(length, weight, np.float32)},
    )


def _requests(with_bad: bool) -> list[PassRequest]:
    good = PassRequest(
        "good", "good", "custom", {}, False, [_datum(1, 20), _datum(2, 9)], _loss(weighted)
    )
    # The bad tenant's long row runs (and reaches the backward) in the first micro-batch; its
    # short row, whose weights sum to 0.5, is NaN in a later one. Its built-in request beside it
    # must then run again without it.
    bad = PassRequest(
        "bad",
        "bad",
        "custom",
        {},
        False,
        [_datum(3, 60), _datum(4, 5, weight=0.1)],
        _loss(nan_when_light),
    )
    bad_builtin = PassRequest("bad-2", "bad", "cross_entropy", {}, False, [_datum(5, 12)])
    broken = PassRequest(
        "broken", "broken", "custom", {}, False, [_datum(6, 7)], _loss(fails_on_odd_lengths)
    )
    builtin = PassRequest("builtin", "builtin", "cross_entropy", {}, False, [_datum(7, 30)])
    if with_bad:
        return [good, bad, bad_builtin, broken, builtin]
    return [good, bad_builtin, builtin]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def _engine(model_dir: Path) -> LocalTrainingEngine:
    engine = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, micro_batch_tokens=64)
    for n, model in enumerate(MODELS):
        engine.create_model(model, LoraSpec(rank=4, seed=n))
    return engine


def _after_step(engine: LocalTrainingEngine) -> dict[str, Any]:
    """Each tenant's gradient, as the step it makes and the logprobs after it."""
    norms = engine.optim_step([OptimRequest(m, STEP) for m in MODELS])
    probe = [_datum(9, 16)]
    after = engine.run_passes(
        [PassRequest(f"p-{m}", m, "cross_entropy", {}, True, probe) for m in MODELS]
    )
    return {
        m: (norms[m]["grad_norm:mean"], r.outputs[0]["logprobs"])
        for m, r in zip(MODELS, after, strict=True)
    }


def test_a_nan_or_failing_request_fails_alone_in_one_call(model_dir: Path) -> None:
    alone = _engine(model_dir)
    want = {r.request_id: r for r in alone.run_passes(_requests(with_bad=False))}
    want_after = _after_step(alone)

    engine = _engine(model_dir)
    got: dict[str, PassResult] = {r.request_id: r for r in engine.run_passes(_requests(True))}
    assert got["bad"].error is not None and "nan" in got["bad"].error.lower()
    assert "nan_when_light" in got["bad"].error
    assert got["broken"].error is not None and "graph.nodes[" in got["broken"].error
    assert "reshape" in got["broken"].error
    for rid, res in want.items():
        assert got[rid].error is None, rid
        assert got[rid].metrics == pytest.approx(res.metrics, abs=1e-5), rid
        for a, b in zip(got[rid].outputs, res.outputs, strict=True):
            np.testing.assert_allclose(a["logprobs"], b["logprobs"], atol=1e-5, rtol=0)
    got_after = _after_step(engine)
    for model in MODELS:  # the failed requests left no gradient behind, the others theirs
        assert got_after[model][0] == pytest.approx(want_after[model][0], rel=1e-5, abs=1e-7)
        np.testing.assert_allclose(got_after[model][1], want_after[model][1], atol=1e-5)
    assert got_after["good"][0] > 0 and got_after["bad"][0] > 0  # both did train
    assert got_after["broken"][0] == 0  # nothing of its failed request reached its adapter
