"""MultiLoRAExperts: every (adapter, expert) LoRA of a projection as ONE grouped GEMM pair equals
the per-adapter path it replaced (fp32, CPU), outputs and every adapter's gradients, for each
expert layout the zoo has: gated SwiGLU (qwen3_moe, deepseek_v3), gate-less relu^2 (nemotron_h),
biased and clamped with interleaved gate|up (gpt_oss).

Equal means within fp32 rounding of the largest value compared (1e-6 of it): the zero-padded
ranks and the K x E grouping change the order of the sums, nothing else."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lockstep.modeling import experts as experts_module
from lockstep.modeling import grouped_gemm, zoo
from lockstep.modeling.experts import MultiLoRAExperts, experts_layout
from lockstep.modeling.grouped_gemm import lora_stack
from lockstep.modeling.routing import Routing, RoutingSlot

FAMILIES = ("qwen3_moe", "deepseek_v3", "nemotron_h", "gpt_oss")
# Rows of 5 tokens: mixed ranks and scales; "b" skips a projection, "c" trains only the down
# projection, "d" trains no expert at all (attention-only tenant), None rows have no adapter.
ROWS = ["b", None, "a", "c", "a", "d", "b", None]
PER_ROW = 5


def _experts(family: str) -> nn.Module:
    settings = dict(zoo.FAMILIES[family])
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **{**zoo._COMMON, "vocab_size": 32, **settings})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    module = next(m for m in model.modules() if experts_layout(m) is not None)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.2)
            p.requires_grad_(False)
    return module


def _layer(family: str) -> tuple[MultiLoRAExperts, RoutingSlot]:
    slot = RoutingSlot()
    layer = MultiLoRAExperts(_experts(family), slot)
    names = list(layer.slots)  # gated: w1 w3 w2; plain: w1 w2
    trained = {"a": names, "b": [n for n in names if n != names[1]], "c": [names[-1]]}
    ranks, scales = {"a": 4, "b": 8, "c": 12}, {"a": 2.0, "b": 0.5, "c": 3.0}
    gen = torch.Generator().manual_seed(1)
    for adapter, which in trained.items():
        for name in which:
            s = layer.slots[name]
            shape_a = (s.experts, ranks[adapter], s.in_features)
            shape_b = (s.experts, s.out_features, ranks[adapter])
            s.lora_A[adapter] = nn.Parameter(torch.randn(*shape_a, generator=gen) * 0.3)
            s.lora_B[adapter] = nn.Parameter(torch.randn(*shape_b, generator=gen) * 0.3)
            s.scale[adapter] = scales[adapter]
    return layer, slot


def _inputs(layer: MultiLoRAExperts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and a top-2 routing that leaves the last expert empty."""
    gen = torch.Generator().manual_seed(2)
    tokens = len(ROWS) * PER_ROW
    hidden = layer.slots[next(iter(layer.slots))].in_features
    x = torch.randn(tokens, hidden, generator=gen)
    scores = torch.rand(tokens, layer.num_experts - 1, generator=gen)
    index = scores.topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=gen)
    return x, index, weights


def _run(
    layer: MultiLoRAExperts, slot: RoutingSlot, routing: Routing | None, grouped: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and the gradients of the input and every adapter tensor, one forward + backward:
    the grouped path, or the reference (per adapter, a matmul per expert)."""
    experts_module.GROUPED_ADAPTERS = grouped
    try:
        x, index, weights = _inputs(layer)
        x.requires_grad_()
        slot.current = routing
        y = layer(x, index, weights)
        slot.current = None
        params = {
            f"{w}.{adapter}.{ab}": t
            for w, s in layer.slots.items()
            for ab, group in (("A", s.lora_A), ("B", s.lora_B))
            for adapter, t in group.items()
        }
        for p in params.values():
            p.grad = None
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        assert x.grad is not None
        grads = {"input": x.grad}
        for key, p in params.items():
            if routing is None:
                continue
            assert p.grad is not None, key
            grads[key] = p.grad
        return y.detach(), grads
    finally:
        experts_module.GROUPED_ADAPTERS = True
        grouped_gemm.GROUPED_KERNEL = True


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_adapter_pairs_equal_the_per_adapter_path(family: str) -> None:
    layer, slot = _layer(family)
    routing = Routing(ROWS, None)
    grouped, grouped_grads = _run(layer, slot, routing, grouped=True)
    per_adapter, per_adapter_grads = _run(layer, slot, routing, grouped=False)
    _assert_close(grouped, per_adapter, "output")
    assert grouped_grads.keys() == per_adapter_grads.keys()
    for key, g in grouped_grads.items():
        _assert_close(g, per_adapter_grads[key], key)
        assert g.abs().max() > 0, key  # every trained tensor is reached
    # Rows without an expert adapter ("d" and None) are the base layer's, exactly.
    base, _ = _run(layer, slot, None, grouped=True)
    plain = torch.tensor([a in (None, "d") for a in ROWS]).repeat_interleave(PER_ROW)
    assert torch.equal(grouped[plain], base[plain])
    assert (grouped[~plain] - base[~plain]).abs().max() > 1e-3


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert (got - want).abs().max() <= 1e-6 * want.abs().max(), what


def test_lora_stack_pads_ranks_with_zeros_and_keeps_gradients() -> None:
    gen = torch.Generator().manual_seed(3)
    a1 = nn.Parameter(torch.randn(3, 2, 8, generator=gen))
    b1 = nn.Parameter(torch.randn(3, 12, 2, generator=gen))
    a2 = nn.Parameter(torch.randn(3, 5, 8, generator=gen))
    b2 = nn.Parameter(torch.randn(3, 12, 5, generator=gen))
    a, b = lora_stack([(a1, b1), None, (a2, b2)], torch.float32)
    assert a.shape == (9, 8, 8) and b.shape == (9, 12, 8)  # rank 5 -> 8: whole 16-byte rows
    assert torch.equal(a[:3, :2], a1) and torch.equal(a[6:, :5], a2)
    assert not a[:3, 2:].any() and not a[3:6].any() and not b[3:6].any()
    assert torch.equal(b[:3, :, :2], b1) and not b[6:, :, 5:].any()
    (a.sum() + b.sum()).backward()
    for p in (a1, b1, a2, b2):
        assert p.grad is not None and torch.equal(p.grad, torch.ones_like(p))


def test_lora_stack_casts_exactly_as_each_adapter_alone() -> None:
    """The stack in bf16 (one copy-and-cast of every adapter) holds each adapter's own bf16
    cast, padded with zeros, and gives each adapter the fp32 cast of its slot's gradient."""
    gen = torch.Generator().manual_seed(4)
    shapes = [((3, 4, 16), (3, 24, 4)), ((3, 8, 16), (3, 24, 8)), ((3, 8, 16), (3, 24, 8))]
    weights = [
        (nn.Parameter(torch.randn(a, generator=gen)), nn.Parameter(torch.randn(b, generator=gen)))
        for a, b in shapes
    ]
    a, b = lora_stack(weights, torch.bfloat16)
    assert a.dtype == b.dtype == torch.bfloat16 and a.shape == (9, 8, 16) and b.shape == (9, 24, 8)
    for k, (wa, wb) in enumerate(weights):
        r = wa.shape[1]
        assert torch.equal(a[3 * k : 3 * k + 3, :r], wa.detach().bfloat16())
        assert torch.equal(b[3 * k : 3 * k + 3, :, :r], wb.detach().bfloat16())
    assert not a[:3, 4:].any() and not b[:3, :, 4:].any()
    grad_a = torch.randn(a.shape, generator=gen).bfloat16().mT.contiguous().mT  # strided
    grad_b = torch.randn(b.shape, generator=gen).bfloat16()
    torch.autograd.backward([a, b], [grad_a, grad_b])
    for k, (wa, wb) in enumerate(weights):
        r = wa.shape[1]
        assert wa.grad is not None and wb.grad is not None and wa.grad.is_contiguous()
        assert torch.equal(wa.grad, grad_a[3 * k : 3 * k + 3, :r].float())
        assert torch.equal(wb.grad, grad_b[3 * k : 3 * k + 3, :, :r].float())
