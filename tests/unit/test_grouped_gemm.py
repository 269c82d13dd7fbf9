"""The grouped GEMM under a backend's group limit, emulated on the CPU.

CUDA's `torch._grouped_mm` refuses more than 1024 groups in one call (measured on an H200); the
CPU kernel has no limit, so these tests wrap it to refuse what CUDA refuses and give the CPU the
same limit (`GROUP_LIMITS`). Every path must cut its calls under it and compute what the uncut
call computes: the grouped GEMM alone, the MoE layer's (adapter, expert) LoRA at every K x E up
to 64 tenants x 256 experts, and a packed cycle of the trainer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import grouped_gemm, zoo
from lockstep.modeling.experts import MultiLoRAExperts, experts_layout
from lockstep.modeling.grouped_gemm import cuts_between, group_ends, grouped_mm
from lockstep.modeling.routing import Routing, RoutingSlot
from lockstep.workers.local.trainer import LocalTrainingEngine

CUDA_LIMIT = 1024


class EmulatedLimit:
    """torch._grouped_mm refusing more than `limit` groups as CUDA does, and the CPU's limit set
    to it; records the group count of every kernel call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.calls: list[int] = []
        kernel = torch._grouped_mm

        def refusing(
            x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, **kwargs: object
        ) -> torch.Tensor:
            groups = int(offs.shape[0])
            self.calls.append(groups)
            if groups > self.limit:
                raise RuntimeError(f"Can't process more than {self.limit} groups")
            return kernel(x, w, offs=offs, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(torch, "_grouped_mm", refusing)
        self.set(CUDA_LIMIT)

    def set(self, limit: int) -> None:
        self.limit = limit
        self._monkeypatch.setitem(grouped_gemm.GROUP_LIMITS, "cpu", limit)

    def lift_cuts(self) -> None:
        """The code no longer knows of a limit (the kernel still refuses): the uncut path."""
        self._monkeypatch.delitem(grouped_gemm.GROUP_LIMITS, "cpu")


@pytest.fixture()
def emulated(monkeypatch: pytest.MonkeyPatch) -> EmulatedLimit:
    return EmulatedLimit(monkeypatch)


def _operands(
    groups: int, rows: int, seed: int, empty: float = 0.3
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, 8], w [groups, 8, 4], sorted group ends with about `empty` of the groups empty."""
    gen = torch.Generator().manual_seed(seed)
    live = torch.nonzero(torch.rand(groups, generator=gen) >= empty).flatten()
    which = live[torch.randint(len(live), (rows,), generator=gen)].sort().values
    x = torch.randn(rows, 8, generator=gen, requires_grad=True)
    w = torch.randn(groups, 8, 4, generator=gen, requires_grad=True)
    return x, w, group_ends(which, groups)


def _value_and_grads(
    fn: Callable[[], torch.Tensor], *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    for t in inputs:
        t.grad = None
    y = fn()
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return (y.detach(), *(t.grad for t in inputs if t.grad is not None))


def test_the_emulated_kernel_refuses_what_cuda_refuses(emulated: EmulatedLimit) -> None:
    x, w, ends = _operands(CUDA_LIMIT + 1, 600, seed=0)
    emulated.lift_cuts()
    with pytest.raises(RuntimeError, match="more than 1024 groups"):
        grouped_mm(x, w, ends)


@pytest.mark.parametrize(
    ("groups", "limit", "rows"),
    [(40, 7, 300), (64, 16, 100), (33, 32, 5), (100, 1, 250), (17, 17, 60), (1500, 1024, 900)],
)
def test_cut_calls_equal_the_uncut_call(
    emulated: EmulatedLimit, groups: int, limit: int, rows: int
) -> None:
    x, w, ends = _operands(groups, rows, seed=groups)
    emulated.set(groups)  # one call takes every group: the reference
    want = _value_and_grads(lambda: grouped_mm(x, w, ends), x, w)
    assert emulated.calls == [groups]
    emulated.set(limit)
    emulated.calls.clear()
    got = _value_and_grads(lambda: grouped_mm(x, w, ends), x, w)
    assert emulated.calls and max(emulated.calls) <= limit
    assert sum(emulated.calls) <= groups  # runs without rows are skipped
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_cuts_known_on_the_host_fall_on_whole_parts(emulated: EmulatedLimit) -> None:
    """An adapter's experts (a part) are never split; the host's row counts place the cuts."""
    experts, rows_per_adapter = 8, [5, 0, 7, 3, 9, 0, 2]
    assert cuts_between(experts, rows_per_adapter, None) is None
    assert cuts_between(experts, rows_per_adapter, 56) is None  # 7 x 8 = 56 groups fit
    assert cuts_between(experts, rows_per_adapter, 4) is None  # a part alone is over: device
    assert cuts_between(experts, rows_per_adapter, 20) == [(16, 5), (32, 15), (48, 24)]
    gen = torch.Generator().manual_seed(5)
    adapter = torch.repeat_interleave(torch.arange(7), torch.tensor(rows_per_adapter))
    key = adapter * experts + torch.randint(experts, adapter.shape, generator=gen)
    key = key.sort().values
    ends = group_ends(key, 7 * experts)
    x = torch.randn(len(key), 8, generator=gen, requires_grad=True)
    w = torch.randn(7 * experts, 8, 4, generator=gen, requires_grad=True)
    want = _value_and_grads(lambda: grouped_mm(x, w, ends), x, w)
    emulated.set(20)
    emulated.calls.clear()
    cuts = cuts_between(experts, rows_per_adapter, 20)
    got = _value_and_grads(lambda: grouped_mm(x, w, ends, cuts), x, w)
    assert emulated.calls == [16, 16, 16, 8]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _experts_layer(experts: int, tenants: int) -> tuple[MultiLoRAExperts, RoutingSlot]:
    """A Qwen3-MoE experts layer of `experts` experts (tiny widths) with `tenants` adapters of
    mixed ranks on every projection."""
    config = AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    base = next(m for m in model.modules() if experts_layout(m) is not None)
    for p in base.parameters():
        p.requires_grad_(False)
    slot = RoutingSlot()
    layer = MultiLoRAExperts(base, slot)
    gen = torch.Generator().manual_seed(1)
    for t in range(tenants):
        rank = (2, 4, 8)[t % 3]
        for s in layer.slots.values():
            a = torch.randn(s.experts, rank, s.in_features, generator=gen) * 0.3
            b = torch.randn(s.experts, s.out_features, rank, generator=gen) * 0.3
            s.lora_A[f"t{t}"] = nn.Parameter(a)
            s.lora_B[f"t{t}"] = nn.Parameter(b)
            s.scale[f"t{t}"] = 0.5 + t / tenants
    return layer, slot


def _layer_run(
    layer: MultiLoRAExperts, slot: RoutingSlot, tenants: int, rows_per_tenant: int
) -> tuple[torch.Tensor, ...]:
    """Output and the gradients of the input and every adapter tensor of one forward+backward:
    each tenant's rows routed over all experts."""
    gen = torch.Generator().manual_seed(2)
    rows = [f"t{t}" for t in range(tenants) for _ in range(rows_per_tenant)]
    tokens = len(rows) * 4
    x = torch.randn(tokens, 16, generator=gen, requires_grad=True)
    index = torch.rand(tokens, layer.num_experts, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(tokens, 2, generator=gen)
    params = [p for s in layer.slots.values() for d in (s.lora_A, s.lora_B) for p in d.values()]

    def forward() -> torch.Tensor:
        slot.current = Routing(rows, None)
        try:
            return layer(x, index, weights)
        finally:
            slot.current = None

    return _value_and_grads(forward, x, *params)


@pytest.mark.parametrize(
    ("tenants", "experts", "limit"),
    [(64, 256, CUDA_LIMIT), (8, 256, CUDA_LIMIT), (5, 256, CUDA_LIMIT), (7, 8, 16), (3, 8, 8)],
)
def test_every_k_by_e_stays_under_the_limit_and_equals_the_uncut_layer(
    emulated: EmulatedLimit, tenants: int, experts: int, limit: int
) -> None:
    layer, slot = _experts_layer(experts, tenants)
    emulated.set(tenants * experts)  # the reference: every (adapter, expert) group in one call
    want = _layer_run(layer, slot, tenants, rows_per_tenant=2)
    assert max(emulated.calls) == tenants * experts
    emulated.set(limit)
    emulated.calls.clear()
    got = _layer_run(layer, slot, tenants, rows_per_tenant=2)
    assert max(emulated.calls) <= limit
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.abs().max() > 0, i  # every adapter tensor is reached
        torch.testing.assert_close(a, b, rtol=0, atol=0)


ADAM = AdamConfig(learning_rate=1e-2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo.ensure_family("qwen3_moe", tmp_path_factory.mktemp("zoo"))


def _datum(length: int, seed: int) -> Datum:
    t = np.random.default_rng(seed).integers(5, 1000, size=length + 1)
    return Datum(
        tokens=t[:-1].astype(np.int64),
        loss_inputs={"target_tokens": t[1:].astype(np.int64), "weights": np.ones(length, "f4")},
    )


def test_a_packed_cycle_of_many_tenants_runs_under_the_limit_and_equals_each_alone(
    emulated: EmulatedLimit, moe_dir: Path
) -> None:
    """Six tenants of an 8-expert model: 48 (adapter, expert) groups under a limit of 16. The
    fused pass runs (it is not re-run request by request), and each tenant's logprobs and
    adapter update equal its own pass alone."""
    emulated.set(16)
    engine = LocalTrainingEngine(moe_dir, zoo.served_name("qwen3_moe"), device="cpu")
    try:
        tenants = [f"m{i}" for i in range(6)]
        for i, name in enumerate(tenants):
            engine.create_model(name, LoraSpec(rank=4 + 4 * (i % 2), alpha=8.0, seed=i))
        requests = [
            PassRequest(f"r{i}", name, "cross_entropy", {}, False, [_datum(12 + i, i)])
            for i, name in enumerate(tenants)
        ]
        emulated.calls.clear()
        packed = engine.run_passes(requests)
        assert max(emulated.calls) == 16  # 48 groups, cut into runs of two adapters
        packed_grads = {n: _grads(engine, n) for n in tenants}
        for request, result in zip(requests, packed, strict=True):
            alone = engine.run_passes([request])[0]
            np.testing.assert_allclose(
                alone.outputs[0]["logprobs"], result.outputs[0]["logprobs"], rtol=0, atol=1e-5
            )
            alone_grads = _grads(engine, request.model_id)
            for g1, g2 in zip(alone_grads, packed_grads[request.model_id], strict=True):
                torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
        engine.optim_step([OptimRequest(n, ADAM) for n in tenants])
    finally:
        engine.close()


def _grads(engine: LocalTrainingEngine, model_id: str) -> list[torch.Tensor]:
    params = engine._lora.adapter_parameters(model_id)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads
