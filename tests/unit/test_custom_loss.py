"""Custom losses against the SDK's own tracer: every name the tracer emits for the ops real
losses use is allowed, the rebuilt program computes what the SDK's traced GraphModule computes
(loss, metrics, gradient w.r.t. logprobs), and the pricing sees what each graph costs (every
op's temporaries, the backward included), refusing by node what a datum's pass cannot afford."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.custom_loss import graph, pricing, program
from lockstep.custom_loss.bound import (
    FLOOR_FLOPS_PER_TOKEN,
    CostBound,
    model_flops_per_token,
)
from lockstep.engine.types import CustomLoss, CustomLossNode, Datum, MemoryBudget
from lockstep.errors import UserInputError

# A trainer with 8 GiB for a pass and a model small enough that the floor sets the FLOP bound.
BOUND = CostBound.of(0, MemoryBudget(8 << 30, 4096, "test"))
MAX_TOKENS = 4096


def dpo(logprobs, chosen_mask, rejected_mask, ref_chosen, ref_rejected):  # type: ignore[no-untyped-def]
    chosen = (logprobs * chosen_mask).sum() - ref_chosen
    rejected = (logprobs * rejected_mask).sum() - ref_rejected
    margin = 0.5 * (chosen - rejected)
    return -F.logsigmoid(margin), {"custom/margin:mean": margin}


def ppo_kl(logprobs, old, ref, adv, mask):  # type: ignore[no-untyped-def]
    ratio = torch.exp(logprobs - old)
    pg = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    loss = ((pg + 0.1 * kl) * mask).sum() / mask.sum().clamp(min=1.0)
    return loss, {"custom/kl:sum": (kl * mask).sum()}


def topk_reverse_kl(logprobs, weights):  # type: ignore[no-untyped-def]
    # The shape of tinker-cookbook's sdft reverse-KL loss on [T, K] logprobs.
    slot = weights > 0
    teacher = torch.where(slot, torch.log(weights.clamp(min=1e-30)), torch.zeros_like(weights))
    masked = torch.where(slot, logprobs, torch.full_like(logprobs, float("-inf")))
    student = torch.nan_to_num(torch.log_softmax(masked, dim=-1), nan=0.0, neginf=0.0)
    per = (student.exp() * (student - teacher).detach() * slot.float()).sum(dim=-1)
    n = logprobs.shape[0]
    return (per * slot.any(dim=-1).float()).sum() / n, {"custom/kl:mean": per.mean()}


CASES: list[tuple[Any, dict[str, int], dict[str, torch.Tensor]]] = [
    (
        dpo,
        {"logprobs": 1, "chosen_mask": 1, "rejected_mask": 1, "ref_chosen": 0, "ref_rejected": 0},
        {
            "chosen_mask": torch.tensor([0, 1, 1, 0, 0, 0.0]),
            "rejected_mask": torch.tensor([0, 0, 0, 1, 1, 1.0]),
            "ref_chosen": torch.tensor(-3.0),
            "ref_rejected": torch.tensor(-4.0),
        },
    ),
    (
        ppo_kl,
        {"logprobs": 1, "old": 1, "ref": 1, "adv": 1, "mask": 1},
        {
            "old": torch.linspace(-3, -1, 6),
            "ref": torch.linspace(-2, -2.5, 6),
            "adv": torch.linspace(-1, 1, 6),
            "mask": torch.tensor([0, 1, 1, 1, 1, 1.0]),
        },
    ),
    (
        topk_reverse_kl,
        {"logprobs": 2, "weights": 2},
        {"weights": torch.tensor([[0.5, 0.5, 0.0]] * 3 + [[0.0, 0.0, 0.0]] * 3)},
    ),
]


def _rebuild(fn: Any, ranks: dict[str, int], loss_id: str | None = None) -> tuple[Any, CustomLoss]:
    handle = trace_loss(fn, ranks, "s")
    encoded = [  # as the JSON body carries them
        CustomLossNode(d["op"], d["name"], d["target"], tuple(d["args"]), d["kwargs"])
        for d in (n.model_dump(mode="json") for n in encode_graph(handle).nodes)
    ]
    loss = graph.build_loss(
        loss_id or f"id-{fn.__name__}", handle.name, list(ranks.items()), encoded
    )
    return handle, loss


@pytest.mark.parametrize(("fn", "ranks", "inputs"), CASES, ids=[c[0].__name__ for c in CASES])
def test_the_rebuilt_loss_equals_the_sdks_traced_graph(fn: Any, ranks: Any, inputs: Any) -> None:
    handle, loss = _rebuild(fn, ranks)
    pricing.check_created(loss, BOUND, MAX_TOKENS)  # an ordinary loss fits the floor
    shape = (6,) if ranks["logprobs"] == 1 else (6, 3)
    base = -torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 3
    lp_sdk, lp_ours = base.clone().requires_grad_(), base.clone().requires_grad_()
    want, want_metrics = handle.graph(lp_sdk, *(inputs[k] for k in handle.input_names))
    got, got_metrics = program.run(program.program(loss), {"logprobs": lp_ours, **inputs})
    want.backward()
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-6)
    assert set(got_metrics) == set(want_metrics)
    for key in want_metrics:
        got_value = torch.as_tensor(got_metrics[key]).detach()
        want_value = torch.as_tensor(want_metrics[key]).detach()
        assert float(got_value) == pytest.approx(float(want_value), abs=1e-6)
    assert lp_ours.grad is not None and lp_sdk.grad is not None
    torch.testing.assert_close(lp_ours.grad, lp_sdk.grad, atol=1e-6, rtol=0)


def test_the_torch_tables_are_the_allowlist() -> None:
    assert set(program.FUNCTIONS) == graph.ALLOWED_FUNCTIONS
    assert set(program.METHODS) == graph.ALLOWED_METHODS
    assert not {"item", "tolist", "numpy", "backward", "exp_", "copy_"} & graph.ALLOWED_METHODS
    assert not {"torch.load", "torch.save", "torch.empty"} & graph.ALLOWED_FUNCTIONS


# ---------------------------------------------------------------- the issue's hostile graphs


def literal_list_index(logprobs, weights):  # type: ignore[no-untyped-def]
    return (logprobs[[100000]] * weights[0]).sum(), {}


def literal_index(logprobs, weights):  # type: ignore[no-untyped-def]
    return logprobs[100000] * weights.sum(), {}


def write_out(logprobs, weights):  # type: ignore[no-untyped-def]
    torch.mul(weights, 0, out=weights)
    return (logprobs * weights).sum(), {}


def broadcast_mse(logprobs, weights):  # type: ignore[no-untyped-def]
    a, b = logprobs.new_ones(20000, 1), logprobs.new_ones(1, 20000)
    return F.mse_loss(a, b) + (logprobs * weights).sum(), {}


def einsum_storm(logprobs, weights):  # type: ignore[no-untyped-def]
    a = logprobs.new_ones(2048, 2048)
    total = (logprobs * weights).sum()
    for _ in range(100):
        total = total + torch.einsum("ik,jk,ij->", a, a, a)
    return total, {}


# name -> (loss, the node the refusal names, what it says)
HOSTILE: dict[str, tuple[Any, str, str]] = {
    "a literal list index past any datum": (literal_list_index, "getitem", "out of range"),
    "a literal index past any datum": (literal_index, "getitem", "out of range"),
    "out= into the datum's input": (write_out, "mul", "keyword 'out' writes"),
    "mse_loss's broadcast temporary": (broadcast_mse, "mse_loss", "FLOPs"),
    "100 einsums of 2048x2048": (einsum_storm, "einsum", "FLOPs"),
}
W = {"logprobs": 1, "weights": 1}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_the_issues_hostile_graphs_are_refused_at_creation_naming_the_node(case: str) -> None:
    fn, node, says = HOSTILE[case]
    with pytest.raises(UserInputError) as refused:
        _, loss = _rebuild(fn, W)
        pricing.check_created(loss, BOUND, MAX_TOKENS)
    assert refused.value.field.startswith("graph.nodes[")
    index = int(refused.value.field.removeprefix("graph.nodes[").removesuffix("]"))
    handle = trace_loss(fn, W, "s")
    assert list(handle.graph.graph.nodes)[index].name.startswith(node)
    assert f"'{node}" in refused.value.detail and says in refused.value.detail


def test_the_counter_sees_temporaries_inside_ops_and_the_backward() -> None:
    _, loss = _rebuild(broadcast_mse, W)
    price = pricing.priced(loss, pricing.probe_shapes(loss))
    # The broadcast difference and its square, [20000, 20000] fp32 each, behind a scalar.
    assert price.peak_bytes >= 2 * 20000 * 20000 * 4
    assert price.peak_at is not None and price.peak_at[1] == "mse_loss"
    _, storm = _rebuild(einsum_storm, W)
    flops = pricing.priced(storm, pricing.probe_shapes(storm)).flops
    assert flops >= 100 * 2 * 2048**3  # each einsum's contraction is a [2048]^3 matmul

    def square(logprobs, weights):  # type: ignore[no-untyped-def]
        return ((logprobs * weights) ** 2).sum(), {}

    _, sq = _rebuild(square, W)
    t = 1 << 12
    shapes = (((t,), "float32"), ((t,), "float32"))
    forward = 3 * t  # mul, pow, sum: one FLOP per element each
    assert pricing.priced(sq, shapes).flops > 2 * forward  # the backward counted too


def test_in_place_keywords_are_refused_by_name() -> None:
    def relu_in_place(logprobs, weights):  # type: ignore[no-untyped-def]
        return F.relu(logprobs * weights, inplace=True).sum(), {}

    with pytest.raises(UserInputError, match="keyword 'inplace' writes"):
        _rebuild(relu_in_place, W)


# ---------------------------------------------------------------- per datum, by bucket


def outer(logprobs, weights):  # type: ignore[no-untyped-def]
    return (logprobs[:, None] * weights[None, :]).sum(), {}  # [T, T]: grows as T^2


def _datum(t: int, k: int | None = None) -> Datum:
    shape = (t,) if k is None else (t, k)
    return Datum(
        np.zeros(t, np.int64),
        {"target_tokens": np.zeros(shape, np.int64), "weights": np.ones(shape, np.float32)},
    )


def test_cost_that_grows_with_the_data_is_refused_on_that_datums_shapes() -> None:
    _, loss = _rebuild(outer, W, "id-outer-grows")
    pricing.check_created(loss, BOUND, MAX_TOKENS)  # 64 x 64 at the probe shapes
    pricing.check_data(loss, [_datum(2000)], BOUND)  # ~1e7 FLOPs: within 2000 * 65536
    tight = CostBound(FLOOR_FLOPS_PER_TOKEN, 4 << 20)  # 4 MiB of temporaries
    with pytest.raises(UserInputError) as refused:
        pricing.check_data(loss, [_datum(8), _datum(2000)], tight)
    assert refused.value.field == "data[1]"
    assert "graph.nodes[" in refused.value.detail and "MiB of temporaries" in refused.value.detail


def test_a_request_of_4096_datums_prices_each_bucket_once() -> None:
    _, loss = _rebuild(ppo_kl, {"logprobs": 1, "old": 1, "ref": 1, "adv": 1, "mask": 1})
    lengths = np.random.default_rng(0).integers(1, 4097, 4096)
    data = []
    for t in lengths:
        x = np.zeros(t, np.float32)
        data.append(
            Datum(
                np.zeros(t, np.int64),
                {"target_tokens": np.zeros(t, np.int64), "old": x, "ref": x, "adv": x, "mask": x},
            )
        )
    pricing.check_created(loss, BOUND, MAX_TOKENS)
    before = {k for k in pricing._PRICES if k[0] == loss.loss_id}
    pricing.check_data(loss, data, BOUND)
    priced = {k for k in pricing._PRICES if k[0] == loss.loss_id} - before
    # One price per power-of-two bucket of T (1, 2, 4, ..., 4096), never one per datum.
    assert len(priced) <= 13
    assert {shapes[0][0][0] for _, shapes in priced} <= {1 << n for n in range(13)}


def test_a_datum_over_the_bound_at_its_buckets_top_is_priced_on_its_own_shapes() -> None:
    _, loss = _rebuild(outer, W, "id-outer-exact")
    pricing.check_created(loss, BOUND, MAX_TOKENS)
    own = pricing.priced(loss, pricing.datum_shapes(loss, _datum(1100)))
    top = pricing.priced(loss, pricing.datum_shapes(loss, _datum(2048)))
    between = CostBound(own.flops // 1100 + 1, 1 << 40)  # fits 1100 tokens, not 2048
    assert pricing.over(loss, top, 1100, between) is not None
    pricing.check_data(loss, [_datum(1100)], between)  # its bucket says no, its shapes yes


def test_indices_are_checked_against_each_datums_real_shape() -> None:
    def last_and_hundredth(logprobs, weights):  # type: ignore[no-untyped-def]
        return logprobs[-1] * weights[0] + logprobs[100], {}

    _, loss = _rebuild(last_and_hundredth, W)
    pricing.check_created(loss, BOUND, MAX_TOKENS)  # fits a datum of more than 100 tokens
    pricing.check_data(loss, [_datum(101), _datum(120)], BOUND)
    with pytest.raises(UserInputError) as refused:
        pricing.check_data(loss, [_datum(120), _datum(100)], BOUND)  # bucket (64, 128]
    assert refused.value.field == "data[1]"
    assert "graph.nodes[" in refused.value.detail and "index 100 is out of range" in str(
        refused.value
    )
    # On real tensors too: the host refuses the index before any kernel could read past the end.
    prog = program.program(loss)
    with pytest.raises(program.NodeError, match="out of range"):
        program.run(prog, {"logprobs": torch.zeros(50), "weights": torch.ones(50)})


def test_sizes_computed_from_shapes_are_priced_on_each_datums_own_shapes() -> None:
    def shrinking(logprobs, weights):  # type: ignore[no-untyped-def]
        n = logprobs.shape[0]
        big = logprobs.new_ones(100000 // (n - 32), 64)  # larger for the smaller datums
        return (logprobs * weights).sum() + big.sum(), {}

    _, loss = _rebuild(shrinking, W)
    pricing.check_created(loss, BOUND, MAX_TOKENS)
    tight = CostBound(1 << 30, 8 << 20)  # 8 MiB of temporaries
    pricing.check_data(loss, [_datum(64)], tight)  # 3125 x 64 fp32: fits
    with pytest.raises(UserInputError, match="MiB of temporaries"):
        pricing.check_data(loss, [_datum(33)], tight)  # same bucket, 100000 x 64: does not


def test_the_bound_follows_the_model_and_keeps_a_floor() -> None:
    qwen3_8b = {
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "vocab_size": 151936,
    }
    per_token = model_flops_per_token(qwen3_8b)
    assert 4 * 7e9 < per_token < 4 * 9e9  # ~8B active weights, 2 + 2 FLOPs each
    big = CostBound.of(per_token, MemoryBudget(60 << 30, 32768, "cuda"))
    assert big.flops_per_token == int(per_token * 0.01)
    assert big.memory_bytes == int((60 << 30) * 0.02)
    tiny = CostBound.of(1000, MemoryBudget(0, 0, "not limited"))
    assert tiny.flops_per_token == FLOOR_FLOPS_PER_TOKEN and tiny.memory_bytes > 0


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("FAKE CUDA out of memory. Tried to allocate 2.00 GiB"),
        torch.AcceleratorError("FAKE CUDA error: an illegal memory access was encountered"),
    ],
    ids=["out of memory", "device error"],
)
def test_out_of_memory_and_device_errors_are_not_the_graphs_fault(
    error: Exception, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FAULT INJECTION: an op of the table raises what CUDA raises. Out of memory goes to the
    pass's halving retry and a device error ends the engine, so neither may become the
    graph's 400; any other op error does."""

    def raises(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setitem(program.FUNCTIONS, "torch.exp", raises)

    def exp_loss(logprobs, weights):  # type: ignore[no-untyped-def]
        return torch.exp(logprobs * weights).sum(), {}

    _, loss = _rebuild(exp_loss, W, f"id-exp-{type(error).__name__}")
    inputs = {"logprobs": torch.zeros(4), "weights": torch.ones(4)}
    with pytest.raises(type(error)):
        program.run(program.rebuild(loss), inputs)
    monkeypatch.setitem(program.FUNCTIONS, "torch.exp", lambda x: x.reshape(3, -1))
    with pytest.raises(program.NodeError, match="failed: RuntimeError"):
        program.run(program.rebuild(loss), inputs)
