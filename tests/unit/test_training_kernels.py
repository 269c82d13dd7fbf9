"""Chunked target logprobs, length-aware micro-batches, bf16 and activation checkpointing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.losses import LOSSES, resolve_loss_config
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import ensure_default_model
from lockstep.training.losses import datum_logprobs, datum_targets, loss_from_logprobs
from lockstep.workers.local.micro_batches import micro_batches, padded
from lockstep.workers.local.trainer import LocalTrainingEngine

V = 1024  # tiny model vocab
ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def _datum(rng: np.random.Generator, loss_fn: str, t: int, k: int = 0) -> Datum:
    shape = (t, k) if k else (t,)
    inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, V, shape)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.standard_normal(shape).astype(np.float32)
    else:
        inputs["logprobs"] = (-rng.random(t) * 8).astype(np.float32)
        inputs["advantages"] = rng.standard_normal(t).astype(np.float32)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (rng.random(t) < 0.7).astype(np.float32)
            inputs["sequence_ratio_mask"][0] = 1
    return Datum(rng.integers(0, V, t), inputs)


@pytest.mark.parametrize(
    ("loss_fn", "k"),
    [(name, 0) for name in sorted(LOSSES)]
    + [(name, 3) for name in sorted(LOSSES) if LOSSES[name].allows_2d_targets],
)
def test_chunked_logprobs_equal_full_logits(loss_fn: str, k: int) -> None:
    """Every loss, 1-D and [T, K] targets: chunked == whole-logits logprobs, losses and grads."""
    rng = np.random.default_rng(7)
    datum = _datum(rng, loss_fn, 37, k)
    config = resolve_loss_config(loss_fn, {})
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(V, 16, generator=gen, requires_grad=True)

    def head(h: torch.Tensor) -> torch.Tensor:
        return h @ weight.t()

    # Reference: the whole [T, V] logits at once.
    full = torch.log_softmax(head(hidden), -1).gather(-1, datum_targets(datum, hidden.device))
    ref_lp, ref_loss = loss_from_logprobs(full, datum, loss_fn, config)
    ref_grads = torch.autograd.grad(ref_loss.sum(), [hidden, weight])
    for chunk in (5, 8, 64):  # several chunks (one partial), and one chunk
        lp, loss = loss_from_logprobs(
            datum_logprobs(hidden, datum, head, chunk), datum, loss_fn, config
        )
        grads = torch.autograd.grad(loss.sum(), [hidden, weight])
        assert lp.shape == ref_lp.shape == np.asarray(datum.loss_inputs["target_tokens"]).shape
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            # Gradient entries reach ~15 here and are sums over the vocabulary taken in another
            # order: 1e-5 absolute is a few fp32 ulps of them, so allow 1e-6 relative on top.
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)


def test_chunked_backward_never_holds_all_logits() -> None:
    """Peak autograd-saved memory stays near one chunk's logits, not [T, V]."""
    t, vocab, chunk = 512, 4096, 32
    hidden = torch.randn(t, 16, requires_grad=True)
    weight = torch.randn(vocab, 16)
    targets = torch.randint(0, vocab, (t, 1))
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    from lockstep.training.logprobs import target_logprobs

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp = target_logprobs(hidden, targets, lambda h: h @ weight.t(), chunk)
    assert lp.shape == (t, 1)
    assert max(saved) < t * vocab // 4  # the largest saved tensor is far below the full logits


def test_micro_batches_order_by_length_under_the_budget() -> None:
    lengths = [5, 300, 17, 64, 64, 9, 1000, 33]
    batches = micro_batches(lengths, budget=256)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(lengths, reverse=True)  # longest first
    for b in batches:  # rows packed end to end, each padded only to whole blocks
        packed = sum(padded(lengths[i]) for i in b)
        assert len(b) == 1 or packed <= 256  # only an over-long row goes alone
    assert [6] in batches and [1] in batches
    assert [3, 4, 7, 2, 5, 0] in batches  # 64+64+40+24+16+8 = 216: short rows share one pass


def _run(
    engine: LocalTrainingEngine, reqs: list[PassRequest], steps: list[OptimRequest]
) -> tuple[dict[str, float], dict[str, list[np.ndarray]]]:
    results = engine.run_passes(reqs)
    engine.optim_step(steps)
    return (
        {r.request_id: r.metrics["loss:sum"] for r in results},
        {r.request_id: [o["logprobs"] for o in r.outputs] for r in results},
    )


def _mixed(seed: int, loss_fn: str, lengths: list[int]) -> list[Datum]:
    rng = np.random.default_rng(seed)
    return [_datum(rng, loss_fn, t) for t in lengths]


def test_packing_invariance_across_micro_batch_boundaries(model_dir: Path) -> None:
    """A tenant alone (one micro-batch) == the same tenant packed with others of very different
    lengths over many small micro-batches: losses, logprobs, and weights after two steps."""
    me_data = _mixed(1, "ppo", [3, 41, 17, 90])
    others = [
        ("o1", LoraSpec(rank=4, seed=1), "cross_entropy", [120, 2, 60]),
        ("o2", LoraSpec(rank=16, seed=2, train_mlp=False), "importance_sampling", [33, 33, 7]),
        ("o3", LoraSpec(rank=8, seed=3, train_unembed=False), "cispo", [75, 11]),
    ]
    spec = LoraSpec(rank=8, seed=11)

    def run(
        budget: int, packed: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[torch.Tensor]]:
        eng = LocalTrainingEngine(model_dir, "tiny", device="cpu", micro_batch_tokens=budget)
        eng.create_model("me", spec)
        tenants = others if packed else []
        for mid, s, _, _ in tenants:
            eng.create_model(mid, s)
        losses, logprobs = [], []
        for step in range(2):
            reqs = [
                PassRequest(mid, mid, lf, {}, False, _mixed(10 * step + i, lf, lens))
                for i, (mid, _, lf, lens) in enumerate(tenants)
            ]
            reqs.insert(1, PassRequest("me", "me", "ppo", {}, False, me_data))
            opt = [OptimRequest(mid, ADAM) for mid, *_ in tenants] + [OptimRequest("me", ADAM)]
            loss, lps = _run(eng, reqs, opt)
            losses.append(loss["me"])
            logprobs.append(lps["me"])
        return losses, logprobs, [p.detach().clone() for p in eng._lora.adapter_parameters("me")]

    alone = run(budget=1 << 16, packed=False)  # one micro-batch
    for packed in [run(budget=128, packed=True)]:  # many, cut inside the tenant's rows
        np.testing.assert_allclose(alone[0], packed[0], rtol=0, atol=1e-5)
        for a, b in zip(alone[1], packed[1], strict=True):
            for x, y in zip(a, b, strict=True):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
        for w1, w2 in zip(alone[2], packed[2], strict=True):
            torch.testing.assert_close(w1, w2, rtol=0, atol=1e-5)


def test_engine_logprobs_equal_the_models_full_logits(model_dir: Path) -> None:
    """The engine's chunked, hidden-state path gives the HF model's own logits' logprobs."""
    eng = LocalTrainingEngine(model_dir, "tiny", device="cpu")
    eng.create_model("me", LoraSpec(rank=4, seed=5))
    datum = _mixed(2, "cross_entropy", [50])[0]
    (res,) = eng.run_passes([PassRequest("r", "me", "cross_entropy", {}, True, [datum])])
    ids = torch.from_numpy(np.asarray(datum.tokens, np.int64))[None]
    with torch.no_grad(), eng._lora.row_adapters(["me"]):
        logits = eng._model(input_ids=ids, use_cache=False).logits[0]
    ref = torch.log_softmax(logits, -1).gather(-1, datum_targets(datum, logits.device))[:, 0]
    np.testing.assert_allclose(res.outputs[0]["logprobs"], ref.numpy(), rtol=0, atol=1e-5)


BF16_TOLERANCE = 0.02  # relative, on a datum's loss sum (documented in docs/ARCHITECTURE.md)


def test_bfloat16_on_cpu_stays_close_to_float32(model_dir: Path) -> None:
    data = _mixed(4, "cross_entropy", [40, 12, 70])
    out = {}
    for dtype in ("float32", "bfloat16"):
        eng = LocalTrainingEngine(model_dir, "tiny", device="cpu", dtype=dtype)
        eng.create_model("me", LoraSpec(rank=8, seed=9))
        losses = []
        for _ in range(2):
            (res,) = eng.run_passes([PassRequest("r", "me", "cross_entropy", {}, False, data)])
            losses.append(res.metrics["loss:sum"])
            eng.optim_step([OptimRequest("me", ADAM)])
        params = eng._lora.adapter_parameters("me")
        assert all(p.dtype == torch.float32 for p in params)  # adapters stay fp32
        assert all(m.dtype == torch.float32 for m in eng._adam["me"].exp_avg)  # so does Adam
        out[dtype] = losses
    assert out["float32"][0] != out["bfloat16"][0]  # bf16 really ran
    np.testing.assert_allclose(out["bfloat16"], out["float32"], rtol=BF16_TOLERANCE)


def test_activation_checkpointing_gives_the_same_numbers(model_dir: Path) -> None:
    data = _mixed(5, "importance_sampling", [64, 9, 30])
    weights = []
    for ckpt in ("never", "always"):
        eng = LocalTrainingEngine(
            model_dir, "tiny", device="cpu", activation_checkpointing=ckpt, micro_batch_tokens=64
        )
        eng.create_model("me", LoraSpec(rank=8, seed=9))
        eng.run_passes([PassRequest("r", "me", "importance_sampling", {}, False, data)])
        eng.optim_step([OptimRequest("me", ADAM)])
        weights.append([p.detach().clone() for p in eng._lora.adapter_parameters("me")])
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_sampler_prompt_logprobs_in_chunks_equal_one_pass() -> None:
    from lockstep.engine.types import SampleParams, SampleRequest, SampleResult
    from lockstep.rollout.local.prompts import prompt_scores

    prompt = list(range(3, 40))
    logits = torch.randn(len(prompt), V, generator=torch.Generator().manual_seed(1))
    req = SampleRequest("r", None, prompt, 1, SampleParams(), True, 2, 0, 30)
    out = []
    for chunk in (4, None):
        result = SampleResult("r", [])
        prompt_scores(req, logits, result, chunk)
        out.append(result)
    ref = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert out[0].prompt_logprobs is not None and out[1].prompt_logprobs is not None
    np.testing.assert_allclose(out[0].prompt_logprobs[7:], ref[6:].numpy(), rtol=0, atol=1e-6)
    assert np.isnan(out[0].prompt_logprobs[:7]).all()  # only the last 30 were asked for
    np.testing.assert_equal(out[0].prompt_logprobs, out[1].prompt_logprobs)
    assert out[0].topk_prompt == out[1].topk_prompt
