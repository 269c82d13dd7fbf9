"""Ops per decoder layer do not grow with the number of tenants packed into a cycle.

One cycle of the local trainer (`workers.local.cycle_census`: run_passes + optim_step) with 2 and
with 8 tenants on the tiny dense and MoE models, bf16 base weights and CUDA's code paths chosen
on the CPU (`modeling.cuda_paths`: grouped LoRA GEMMs over every adapter, VARLEN attention
through its stand-in kernel), counted op by op (`modeling.op_census`). A per-adapter or per-row
loop inside a layer would add ops per tenant: the counts at K = 2 and K = 8 must be equal. The
census itself must see such a loop: with the experts' LoRA run per adapter (the path
`experts.GROUPED_ADAPTERS` replaced), the MoE layers' ops grow."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lockstep.modeling import experts, zoo
from lockstep.modeling.cuda_paths import cuda_paths
from lockstep.workers.local.cycle_census import census_cycle
from lockstep.workers.local.trainer import LocalTrainingEngine

TOKENS = 8  # per tenant: one block


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LocalTrainingEngine]]:
    """The tiny dense and MoE models' engines (bf16, one micro-batch for every K here)."""
    zoo_dir = tmp_path_factory.mktemp("zoo")
    built = {
        family: LocalTrainingEngine(
            zoo.ensure_family(family, zoo_dir),
            zoo.served_name(family),
            device="cpu",
            dtype="bfloat16",
            micro_batch_tokens=1024,
        )
        for family in ("qwen3", "qwen3_moe")
    }
    yield built
    for engine in built.values():
        engine.close()


def _census(engine: LocalTrainingEngine, tenants: int) -> dict[str, Any]:
    with cuda_paths():
        return census_cycle(engine, tenants, TOKENS, warm=False)  # layers: the same ops warm


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_ops_per_layer_do_not_grow_with_tenants(
    engines: dict[str, LocalTrainingEngine], family: str
) -> None:
    two, eight = (_census(engines[family], k) for k in (2, 8))
    for census, k in ((two, 2), (eight, 8)):
        assert census["micro_batches"] == 1  # one packed pass
        assert census["unattributed_backward_ops"] == 0
        assert census["attention_calls"] == {"varlen": 2, "sdpa": 0}  # one call per layer
        groups = k * 8 if family == "qwen3_moe" else k  # per (adapter, expert); per adapter
        assert census["max_groups"] == groups
    assert eight["ops_per_layer"] == two["ops_per_layer"] > 0
    assert eight["all_ops_per_layer"] == two["all_ops_per_layer"]  # views too
    for layer_2, layer_8 in zip(two["layers"], eight["layers"], strict=True):
        assert layer_8["parts"] == layer_2["parts"], layer_8["kind"]
    # Every adapter's gradient lands in its tensor without a copy (autograd keeps it as is).
    assert eight["regions"]["grad_accumulate"]["kernel_ops"] == 0
    # The head and loss run per row by design: counted apart, and they do grow.
    assert eight["regions"]["head_loss"]["kernel_ops"] > two["regions"]["head_loss"]["kernel_ops"]


def test_the_census_sees_a_per_adapter_loop(
    engines: dict[str, LocalTrainingEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(experts, "GROUPED_ADAPTERS", False)
    two, eight = (_census(engines["qwen3_moe"], k) for k in (2, 8))
    assert eight["ops_per_layer"] > two["ops_per_layer"]
    grown = [
        (a["parts"]["feed_forward"], b["parts"]["feed_forward"])
        for a, b in zip(two["layers"], eight["layers"], strict=True)
    ]
    assert all(after > before for before, after in grown), grown
