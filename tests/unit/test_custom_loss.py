"""The custom-loss allowlist and rebuild against the SDK's own tracer: every name the tracer
emits for the ops real losses use is allowed, and the rebuilt program computes what the SDK's
traced GraphModule computes (loss, metrics, gradient w.r.t. logprobs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from lockstep.engine import custom_loss as spec
from lockstep.engine.types import CustomLossNode
from lockstep.errors import UserInputError
from lockstep.training import custom_loss as tcl


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


def _rebuild(fn: Any, ranks: dict[str, int]) -> tuple[Any, spec.CustomLoss]:
    handle = trace_loss(fn, ranks, "s")
    encoded = [  # as the JSON body carries them
        CustomLossNode(d["op"], d["name"], d["target"], tuple(d["args"]), d["kwargs"])
        for d in (n.model_dump(mode="json") for n in encode_graph(handle).nodes)
    ]
    loss = spec.build_loss(f"id-{fn.__name__}", handle.name, list(ranks.items()), encoded)
    return handle, loss


@pytest.mark.parametrize(("fn", "ranks", "inputs"), CASES, ids=[c[0].__name__ for c in CASES])
def test_the_rebuilt_loss_equals_the_sdks_traced_graph(fn: Any, ranks: Any, inputs: Any) -> None:
    handle, loss = _rebuild(fn, ranks)
    tcl.check_created(loss)
    shape = (6,) if ranks["logprobs"] == 1 else (6, 3)
    base = -torch.rand(shape, generator=torch.Generator().manual_seed(0)) * 3
    lp_sdk, lp_ours = base.clone().requires_grad_(), base.clone().requires_grad_()
    want, want_metrics = handle.graph(lp_sdk, *(inputs[k] for k in handle.input_names))
    got, got_metrics = tcl._run(tcl.program(loss), {"logprobs": lp_ours, **inputs}, check=False)
    want.backward()
    got.backward()
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-6)
    assert set(got_metrics) == set(want_metrics)
    for key in want_metrics:
        assert float(got_metrics[key]) == pytest.approx(float(want_metrics[key]), abs=1e-6)
    assert lp_ours.grad is not None and lp_sdk.grad is not None
    torch.testing.assert_close(lp_ours.grad, lp_sdk.grad, atol=1e-6, rtol=0)


def test_the_torch_tables_are_the_allowlist() -> None:
    assert set(tcl.FUNCTIONS) == spec.ALLOWED_FUNCTIONS
    assert set(tcl.METHODS) == spec.ALLOWED_METHODS
    assert not {"item", "tolist", "numpy", "backward", "exp_", "copy_"} & spec.ALLOWED_METHODS
    assert not {"torch.load", "torch.save", "torch.empty"} & spec.ALLOWED_FUNCTIONS


def test_sizes_that_grow_with_the_data_are_refused_on_that_datums_shapes() -> None:
    def outer(logprobs, weights):  # type: ignore[no-untyped-def]
        pairs = logprobs[:, None] * weights[None, :]  # [T, T]
        return pairs.sum(), {}

    _, loss = _rebuild(outer, {"logprobs": 1, "weights": 1})
    tcl.check_created(loss)  # 64 x 64 at the probe shapes
    big = {"logprobs": ((4096,), torch.float32), "weights": ((4096,), torch.float32)}
    with pytest.raises(UserInputError, match="elements"):
        tcl.dry_run(tcl.program(loss), big)
