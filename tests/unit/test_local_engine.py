"""LocalTrainingEngine: fused multi-tenant passes, batched AdamW, checkpoints, input errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.errors import UserInputError
from lockstep.modeling.peft_io import load_peft_adapter
from lockstep.modeling.tiny import ensure_default_model
from lockstep.training.optim import AdamGroup, AdamState, batched_adamw_step
from lockstep.workers.local.trainer import LocalTrainingEngine

V = 1024  # tiny model vocab
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def engine(model_dir: Path) -> LocalTrainingEngine:
    return LocalTrainingEngine(model_dir, "tiny", device="cpu")


def _data(seed: int, loss_fn: str, n: int = 3) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        t = int(rng.integers(3, 30))
        inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, V, t)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.standard_normal(t).astype(np.float32)
        else:
            inputs["logprobs"] = (-rng.random(t) * 8).astype(np.float32)
            inputs["advantages"] = rng.standard_normal(t).astype(np.float32)
            inputs["ignored_extra_key"] = np.zeros(2)
        out.append(Datum(rng.integers(0, V, t), inputs))
    return out


def _fb(
    model_id: str,
    data: list[Datum],
    loss_fn: str = "cross_entropy",
    fwd: bool = False,
    config: dict[str, float | str] | None = None,
) -> PassRequest:
    return PassRequest(f"req-{model_id}", model_id, loss_fn, config or {}, fwd, data)


def _weights(engine: LocalTrainingEngine, model_id: str) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine._lora.adapter_parameters(model_id)]


OTHERS = [  # 7 other tenants: mixed ranks, targets, losses, hyperparameters
    (LoraSpec(rank=4, seed=1), "ppo", AdamConfig(learning_rate=3e-3)),
    (LoraSpec(rank=8, seed=2, train_attn=False), "cross_entropy", ADAM),
    (LoraSpec(rank=16, seed=3, train_mlp=False, train_unembed=False), "importance_sampling", ADAM),
    (LoraSpec(rank=32, seed=4), "cispo", AdamConfig(grad_clip_norm=0.5)),
    (LoraSpec(rank=4, seed=5, train_attn=False, train_mlp=False), "dro", ADAM),
    (LoraSpec(rank=8, seed=6), "cross_entropy", AdamConfig(weight_decay=0.3)),
    (LoraSpec(rank=16, seed=7, train_unembed=False), "ppo", ADAM),
]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo"])
def test_packing_does_not_change_a_tenants_numbers(model_dir: Path, loss_fn: str) -> None:
    spec = LoraSpec(rank=8, seed=11, train_mlp=loss_fn != "ppo")
    adam = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
    data = _data(100, loss_fn)

    def run(others: bool) -> tuple[list[float], list[list[np.ndarray]], list[torch.Tensor]]:
        eng = LocalTrainingEngine(model_dir, "tiny", device="cpu")
        eng.create_model("me", spec)
        tenants = [(f"o{i}", s, lf, a) for i, (s, lf, a) in enumerate(OTHERS)] if others else []
        for mid, s, _, _ in tenants:
            eng.create_model(mid, s)
        losses, logprobs = [], []
        for step in range(2):
            reqs = [_fb(mid, _data(int(mid[1:]) * 10 + step, lf), lf) for mid, _, lf, _ in tenants]
            reqs.insert(len(reqs) // 2, _fb("me", data, loss_fn))
            res = {r.request_id: r for r in eng.run_passes(reqs)}["req-me"]
            losses.append(res.metrics["loss:sum"])
            logprobs.append([o["logprobs"] for o in res.outputs])
            eng.optim_step(
                [OptimRequest(m, a) for m, _, _, a in tenants] + [OptimRequest("me", adam)]
            )
        return losses, logprobs, _weights(eng, "me")

    alone, packed = run(False), run(True)
    np.testing.assert_allclose(alone[0], packed[0], rtol=0, atol=1e-5)
    for a, b in zip(alone[1], packed[1], strict=True):
        for x, y in zip(a, b, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    for w1, w2 in zip(alone[2], packed[2], strict=True):
        torch.testing.assert_close(w1, w2, rtol=0, atol=1e-5)


def test_outputs_and_cross_entropy_sum(engine: LocalTrainingEngine) -> None:
    engine.create_model("m", LoraSpec(rank=4))
    data = _data(1, "cross_entropy")
    two_d = Datum(
        np.array([5, 6, 7]),
        {
            "target_tokens": np.array([[1, 2], [3, 4], [5, 6]]),
            "weights": np.full((3, 2), 0.5, np.float32),
        },
    )
    (res,) = engine.run_passes([_fb("m", data + [two_d])])
    total = 0.0
    for d, out in zip(data + [two_d], res.outputs, strict=True):
        assert out["logprobs"].dtype == np.float32
        assert (
            out["logprobs"].shape
            == out["elementwise_loss"].shape
            == d.loss_inputs["target_tokens"].shape
        )
        assert (out["logprobs"] <= 0).all()
        np.testing.assert_allclose(
            out["elementwise_loss"], -out["logprobs"] * d.loss_inputs["weights"], rtol=1e-6
        )
        total += float((-out["logprobs"] * d.loss_inputs["weights"]).sum())
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert all(k.count(":") == 1 for k in res.metrics)


def test_negative_weights_give_the_gradient_of_the_weighted_logprob_sum(
    engine: LocalTrainingEngine,
) -> None:
    engine.create_model("m", LoraSpec(rank=4, seed=0))
    data = _data(2, "cross_entropy", n=2)
    engine.run_passes([_fb("m", data)])
    engine.optim_step([OptimRequest("m", ADAM)])  # B != 0, so every parameter has a gradient
    c = [np.random.default_rng(9).standard_normal(len(d.tokens)).astype(np.float32) for d in data]
    neg = [
        Datum(d.tokens, {"target_tokens": d.loss_inputs["target_tokens"], "weights": -ci})
        for d, ci in zip(data, c, strict=True)
    ]
    engine.run_passes([_fb("m", neg)])
    params = engine._lora.adapter_parameters("m")
    got = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    # Reference: autograd of sum_t c_t * logp_t, one datum at a time through the plain model.
    for d, ci in zip(data, c, strict=True):
        with engine._lora.row_adapters(["m"]):
            logits = engine._model(input_ids=torch.as_tensor(d.tokens)[None]).logits[0]
        logp = torch.log_softmax(logits, -1).gather(
            -1, torch.as_tensor(d.loss_inputs["target_tokens"])[:, None]
        )
        (logp[:, 0] * torch.as_tensor(ci)).sum().backward()
    for g, p in zip(got, params, strict=True):
        assert g is not None and p.grad is not None
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)


def test_forward_only_leaves_grads_alone_and_grads_accumulate(engine: LocalTrainingEngine) -> None:
    engine.create_model("m", LoraSpec(rank=4))
    engine.create_model("n", LoraSpec(rank=8))
    data = _data(3, "cross_entropy")
    fwd, fb = engine.run_passes([_fb("n", data, fwd=True), _fb("m", data)])
    assert all(p.grad is None for p in engine._lora.adapter_parameters("n"))
    assert fwd.metrics["loss:sum"] == pytest.approx(fb.metrics["loss:sum"], abs=1e-5)  # same init
    once = [p.grad.clone() for p in engine._lora.adapter_parameters("m") if p.grad is not None]
    engine.run_passes([_fb("m", data)])
    twice = [p.grad for p in engine._lora.adapter_parameters("m") if p.grad is not None]
    for a, b in zip(once, twice, strict=True):
        torch.testing.assert_close(2 * a, b)
    norms = engine.optim_step([OptimRequest("m", ADAM), OptimRequest("n", ADAM)])
    assert norms["m"]["grad_norm:mean"] > 0 and norms["n"]["grad_norm:mean"] == 0.0
    assert all(p.grad is None for p in engine._lora.adapter_parameters("m"))
    assert engine._adam["n"].step == 0  # no gradient: untouched, as torch.optim would


def test_batched_adamw_matches_torch() -> None:
    torch.manual_seed(0)
    configs = [
        AdamConfig(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1),
        AdamConfig(learning_rate=3e-3, beta1=0.8, beta2=0.999, eps=1e-12, grad_clip_norm=0.05),
        AdamConfig(learning_rate=1e-1, weight_decay=0.5, grad_clip_norm=100.0),
    ]
    shapes: list[list[tuple[int, ...]]] = [[(4, 16), (24, 4)], [(8, 5)], [(2, 3), (3, 2), (7,)]]
    ours = [[torch.nn.Parameter(torch.randn(s)) for s in group] for group in shapes]
    ref = [[torch.nn.Parameter(p.detach().clone()) for p in group] for group in ours]
    opts = [
        torch.optim.AdamW(
            r,
            lr=c.learning_rate,
            betas=(c.beta1, c.beta2),
            eps=c.eps,
            weight_decay=c.weight_decay,
            foreach=False,
        )
        for r, c in zip(ref, configs, strict=True)
    ]
    states = [AdamState() for _ in configs]
    for _ in range(5):
        for group, rgroup in zip(ours, ref, strict=True):
            for p, r in zip(group, rgroup, strict=True):
                g = torch.randn(p.shape)
                p.grad, r.grad = g.clone(), g.clone()
        norms = batched_adamw_step(
            [AdamGroup(g, s, c) for g, s, c in zip(ours, states, configs, strict=True)]
        )
        for rgroup, opt, c, norm in zip(ref, opts, configs, norms, strict=True):
            if c.grad_clip_norm > 0:
                total = torch.nn.utils.clip_grad_norm_(rgroup, c.grad_clip_norm)
            else:
                total = torch.linalg.vector_norm(
                    torch.stack(
                        [torch.linalg.vector_norm(r.grad) for r in rgroup if r.grad is not None]
                    )
                )
            assert norm == pytest.approx(float(total), rel=1e-6)
            opt.step()
        for group, rgroup in zip(ours, ref, strict=True):
            for p, r in zip(group, rgroup, strict=True):
                assert p.grad is None
                torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    assert [s.step for s in states] == [5, 5, 5]


def _continue(
    engine: LocalTrainingEngine, model_id: str, data: list[Datum], steps: int
) -> list[float]:
    out = []
    for _ in range(steps):
        (res,) = engine.run_passes([_fb(model_id, data)])
        out.append(res.metrics["loss:sum"])
        engine.optim_step([OptimRequest(model_id, ADAM)])
    return out


def test_save_and_load_state(engine: LocalTrainingEngine, model_dir: Path, tmp_path: Path) -> None:
    data = _data(5, "cross_entropy")
    for d in data:
        d.loss_inputs["weights"] = np.abs(d.loss_inputs["weights"])
    spec = LoraSpec(rank=8, seed=3, train_unembed=False)
    engine.create_model("m", spec)
    _continue(engine, "m", data, 2)
    size = engine.save_state("m", tmp_path / "ck", include_optimizer=True)
    assert size == sum(p.stat().st_size for p in (tmp_path / "ck").iterdir())
    expected = _continue(engine, "m", data, 3)

    other = LocalTrainingEngine(model_dir, "tiny", device="cpu")
    assert other.load_state("resumed", tmp_path / "ck", include_optimizer=True) == spec
    assert _continue(other, "resumed", data, 3) == expected
    assert other.load_state("fresh", tmp_path / "ck", include_optimizer=False) == spec
    fresh = _continue(other, "fresh", data, 3)
    assert fresh[0] == expected[0]  # same weights
    assert fresh[2] != pytest.approx(expected[2], rel=1e-6)  # fresh Adam moments diverge

    # A checkpoint saved without optimizer cannot be loaded with it.
    engine.save_state("m", tmp_path / "noopt", include_optimizer=False)
    with pytest.raises(UserInputError):
        other.load_state("x", tmp_path / "noopt", include_optimizer=True)
    assert not other.has_model("x")
    # Another base model's checkpoint is refused.
    elsewhere = LocalTrainingEngine(model_dir, "some/other-model", device="cpu")
    with pytest.raises(UserInputError, match="base model"):
        elsewhere.load_state("x", tmp_path / "ck", include_optimizer=False)
    with pytest.raises(UserInputError):
        elsewhere.load_state("x", tmp_path / "nothing-here", include_optimizer=False)


def test_export_adapter_is_peft(engine: LocalTrainingEngine, tmp_path: Path) -> None:
    engine.create_model("m", LoraSpec(rank=4, alpha=16.0, train_mlp=False))
    engine.run_passes([_fb("m", _data(6, "cross_entropy"))])
    engine.optim_step([OptimRequest("m", ADAM)])
    size = engine.export_adapter("m", tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert size == sum(p.stat().st_size for p in (tmp_path / "out").iterdir())
    adapter = load_peft_adapter(tmp_path / "out")
    state, spec = adapter.state, engine._lora.spec_of(adapter.state, adapter.rank, adapter.alpha)
    assert (spec.rank, spec.alpha, spec.train_mlp, spec.train_attn) == (4, 16.0, False, True)
    ours = engine._lora.adapter_state("m")
    assert state.keys() == ours.keys() and all(torch.equal(state[k], ours[k]) for k in ours)


def test_user_input_errors(engine: LocalTrainingEngine) -> None:
    with pytest.raises(UserInputError, match="rank"):
        engine.create_model("m", LoraSpec(rank=0))
    with pytest.raises(UserInputError):
        engine.create_model("m", LoraSpec(train_attn=False, train_mlp=False, train_unembed=False))
    engine.create_model("m", LoraSpec(rank=4))
    with pytest.raises(UserInputError) as info:
        engine.run_passes([_fb("nope", _data(1, "cross_entropy"))])
    assert info.value.field == "model_id"
    # What a request carries is judged at admission (tests/unit/test_request_rules.py): the
    # engine refuses only what its own state decides (unknown models, above; an adapter spec).
    assert all(p.grad is None for p in engine._lora.adapter_parameters("m"))
    engine.delete_model("m")
    engine.delete_model("m")
    assert not engine.has_model("m")


# PEFT asks transformers a question transformers now names otherwise (their warning, not ours).
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_exported_adapter_matches_peft(
    engine: LocalTrainingEngine, model_dir: Path, tmp_path: Path
) -> None:
    """Cross-check with the real PEFT library (a test dependency)."""
    import peft
    from transformers import AutoModelForCausalLM

    engine.create_model("m", LoraSpec(rank=4, alpha=32.0, train_attn=False))
    data = _data(8, "cross_entropy", n=1)
    _continue(engine, "m", data, 2)
    (res,) = engine.run_passes([_fb("m", data, fwd=True)])
    engine.export_adapter("m", tmp_path / "peft")
    base = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor(data[0].tokens)[None]).logits[0]
    targets = torch.as_tensor(data[0].loss_inputs["target_tokens"])
    logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    np.testing.assert_allclose(logp.numpy(), res.outputs[0]["logprobs"], rtol=0, atol=1e-4)
