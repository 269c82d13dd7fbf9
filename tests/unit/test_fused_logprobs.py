"""The fused LM head + log-softmax (`training.logprobs`, FUSED path) against the chunked,
checkpointed path it replaces: logprobs and gradients (hidden states, the head's LoRA) in fp32,
every loss kind, 1-D and [T, K] targets, with and without a LoRA on the head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.losses import resolve_loss_config
from lockstep.engine.types import Datum, LoraSpec, PassRequest
from lockstep.modeling.tiny import ensure_default_model
from lockstep.training import logprobs
from lockstep.training.logprobs import LinearHead, target_logprobs
from lockstep.training.losses import datum_targets, loss_from_logprobs
from lockstep.workers.local.trainer import LocalTrainingEngine

V, H, T, R = 1024, 16, 37, 4


def _datum(rng: np.random.Generator, loss_fn: str, k: int) -> Datum:
    shape = (T, k) if k else (T,)
    inputs: dict[str, np.ndarray] = {"target_tokens": rng.integers(0, V, shape)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = rng.standard_normal(shape).astype(np.float32)
    else:
        inputs["logprobs"] = (-rng.random(T) * 8).astype(np.float32)
        inputs["advantages"] = rng.standard_normal(T).astype(np.float32)
    return Datum(rng.integers(0, V, T), inputs)


def _head(lora: bool, bias: bool) -> tuple[LinearHead, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(V, H, generator=gen)
    b = torch.randn(V, generator=gen) if bias else None
    if not lora:
        return LinearHead(weight, b), []
    lora_a = (torch.randn(R, H, generator=gen) * 0.3).requires_grad_()
    lora_b = (torch.randn(V, R, generator=gen) * 0.3).requires_grad_()
    return LinearHead(weight, b, (lora_a, lora_b, 0.5)), [lora_a, lora_b]


@pytest.mark.parametrize(
    ("loss_fn", "k"),
    [("cross_entropy", 0), ("importance_sampling", 0), ("ppo", 0), ("cross_entropy", 3)],
)
@pytest.mark.parametrize("lora", [False, True], ids=["no-head-lora", "head-lora"])
def test_fused_head_equals_the_checkpointed_path(loss_fn: str, k: int, lora: bool) -> None:
    datum = _datum(np.random.default_rng(7), loss_fn, k)
    config = resolve_loss_config(loss_fn, {})
    head, adapter = _head(lora, bias=lora)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(5), requires_grad=True)
    targets = datum_targets(datum, hidden.device)
    params = [hidden, *adapter]
    for chunk in (5, 64):  # several chunks (one partial), and one chunk
        # Today's path: the same head called as a module, each chunk checkpointed.
        ref_lp, ref_loss = loss_from_logprobs(
            target_logprobs(hidden, targets, head.__call__, chunk), datum, loss_fn, config
        )
        ref_grads = torch.autograd.grad(ref_loss.sum(), params)
        lp, loss = loss_from_logprobs(
            target_logprobs(hidden, targets, head, chunk), datum, loss_fn, config
        )
        grads = torch.autograd.grad(loss.sum(), params)
        torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        for g, r in zip(grads, ref_grads, strict=True):
            # sums over the vocabulary in another order: a few fp32 ulps of entries up to ~10
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-5)
        with torch.no_grad():  # forward only: the same numbers, no graph
            plain = target_logprobs(hidden, targets, head, chunk)
            torch.testing.assert_close(plain.reshape(ref_lp.shape), ref_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["no-head-lora", "head-lora"])
def test_fused_head_never_holds_all_logits(lora: bool) -> None:
    """What the fused function keeps for backward is per position ([T, H], [T]), never [T, V]."""
    t, vocab, chunk = 512, 4096, 32
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(t, 16, generator=gen, requires_grad=True)
    adapter = (torch.randn(4, 16, requires_grad=True), torch.zeros(vocab, 4, requires_grad=True))
    weight = torch.randn(vocab, 16, generator=gen)
    head = LinearHead(weight, None, (*adapter, 1.0) if lora else None)
    targets = torch.randint(0, vocab, (t, 1), generator=gen)
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        lp = target_logprobs(hidden, targets, head, chunk)
    lp.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    assert saved and max(saved) <= vocab * 16  # the head weight [V, H] at most
    assert max(saved) < t * vocab // 4


def test_fused_head_in_bfloat16_stays_close_to_the_checkpointed_path() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(torch.bfloat16)
    hidden = torch.randn(T, H, generator=gen).to(torch.bfloat16).requires_grad_()
    head = LinearHead(weight)
    targets = torch.randint(0, V, (T, 1), generator=gen)
    out = []
    for h in (head, head.__call__):
        lp = target_logprobs(hidden, targets, h, 8)
        (grad,) = torch.autograd.grad(lp.sum(), [hidden])
        out.append((lp, grad.float()))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=0, atol=2e-2)
    torch.testing.assert_close(out[0][1], out[1][1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("unembed", [True, False], ids=["head-lora", "no-head-lora"])
def test_engine_fused_head_equals_the_checkpointed_path(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, unembed: bool
) -> None:
    """The local engine's pass through the fused head == through the checkpointed head: losses,
    logprobs and every adapter gradient (tiny model, fp32)."""
    model_dir: Path = ensure_default_model(tmp_path_factory.mktemp("cache"))
    rng = np.random.default_rng(11)
    data = [_datum(rng, "ppo", 0), _datum(rng, "ppo", 0)]
    results = []
    for fused in (False, True):
        monkeypatch.setattr(logprobs, "FUSED_HEAD", fused)
        engine = LocalTrainingEngine(model_dir, "tiny", device="cpu")
        engine.create_model("me", LoraSpec(rank=8, seed=4, train_unembed=unembed))
        (res,) = engine.run_passes([PassRequest("r", "me", "ppo", {}, False, data)])
        grads = [p.grad.clone() for p in engine._lora.adapter_parameters("me")]
        results.append((res, grads))
    (ref, ref_grads), (res, grads) = results
    assert res.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], abs=1e-5)
    for a, b in zip(res.outputs, ref.outputs, strict=True):
        np.testing.assert_allclose(a["logprobs"], b["logprobs"], rtol=0, atol=1e-5)
    assert len(grads) == len(ref_grads) > 0
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
