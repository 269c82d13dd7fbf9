"""Per-layer activation checkpointing chosen per micro-batch (`--activation-checkpointing auto`):
under a budget the pass would overrun with every activation kept, the layers the pass cost
names rerun in backward, the others run once, and every number equals the pass that keeps
everything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.types import Datum, LoraSpec, PassRequest
from lockstep.modeling.decoder_layers import decoder_layers
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.local.trainer import LocalTrainingEngine

TOKENS = 104  # one micro-batch: rows of 60 + 36 tokens, each padded to a multiple of 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("tiny"))


def _request() -> PassRequest:
    rng = np.random.default_rng(3)
    data = []
    for n in (60, 36):
        t = rng.integers(5, 1000, size=n + 1)
        targets = {"target_tokens": t[1:].astype(np.int64), "weights": np.ones(n, "f4")}
        data.append(Datum(tokens=t[:-1].astype(np.int64), loss_inputs=targets))
    return PassRequest("r", "me", "cross_entropy", {}, False, data)


def _run(engine: LocalTrainingEngine) -> tuple[list[np.ndarray], list[torch.Tensor], list[int]]:
    """Logprobs, the adapter's gradients and each decoder layer's MLP calls of one pass (a
    pre-hook: the recompute stops once the last activation backward needs is back, inside the
    MLP)."""
    engine.create_model("me", LoraSpec(rank=8, seed=4))
    calls = [0] * len(decoder_layers(engine._model))
    hooks = [
        layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(decoder_layers(engine._model))
    ]
    try:
        out = engine.run_passes([_request()])[0]
    finally:
        for hook in hooks:
            hook.remove()
    grads = [p.grad.clone() for p in engine._lora.adapter_parameters("me") if p.grad is not None]
    return [np.asarray(o["logprobs"]) for o in out.outputs], grads, calls


def test_auto_recomputes_only_the_layers_the_budget_needs_and_changes_no_number(
    model_dir: Path,
) -> None:
    kept = LocalTrainingEngine(
        model_dir, "tiny", device="cpu", activation_checkpointing="never", micro_batch_tokens=128
    )
    cost = kept._pass_cost
    layers = len(cost.layers)
    budget = cost.micro_batch_bytes(128, 60, range(layers))  # admits a full micro-batch
    assert budget < cost.micro_batch_bytes(TOKENS, 60)  # this one does not fit as it is
    auto = LocalTrainingEngine(
        model_dir,
        "tiny",
        device="cpu",
        activation_checkpointing="auto",
        memory_budget_bytes=budget,
        micro_batch_tokens=128,
    )
    plan = cost.checkpoint_plan(TOKENS, 60, budget)
    assert plan
    want_logprobs, want_grads, want_calls = _run(kept)
    got_logprobs, got_grads, got_calls = _run(auto)
    assert want_calls == [1] * layers  # nothing recomputed
    assert got_calls == [2 if i in plan else 1 for i in range(layers)]
    for a, b in zip(got_logprobs, want_logprobs, strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(got_grads) == len(want_grads) > 0
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_always_recomputes_every_layer_and_never_none(model_dir: Path) -> None:
    for mode, times in (("always", 2), ("never", 1)):
        engine = LocalTrainingEngine(model_dir, "tiny", device="cpu", activation_checkpointing=mode)
        _, _, calls = _run(engine)
        assert calls == [times] * len(calls), mode
