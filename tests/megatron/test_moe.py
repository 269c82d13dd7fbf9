"""The Megatron engine on the tiny Qwen3-MoE gives the local engine's numbers (fp32) with expert
parallelism: LoRA on attention, every expert's w1 / w3 / w2 and the LM head, 3 tenants packed.

Layouts (gloo on CPU): EP=2 over 2 DP replicas (tokens cross ranks in the all-to-all; the
replicas run unequal numbers of micro-batches), TP=2 (each TP rank routes half the tokens through
all experts), TP=2 x EP=2 (each TP rank routes half the tokens to experts split over the same two
ranks), PP=2 (MoE stages under 1F1B) and EP=2 x PP=2 (4 ranks: both at once). Checked: per-datum
logprobs, `loss:sum`, grad norms and the adapters after two optimizer steps, and that a Megatron
checkpoint has the local engine's keys and 3-D expert shapes (and loads there).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.modeling import zoo
from lockstep.training import checkpoint
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.megatron.parallel import ParallelConfig
from lockstep.workers.megatron.trainer import MegatronTrainingEngine
from tests.megatron.common import TENANTS, assert_records_close, run_workload

# Routers: HF's softmax, top-k, renormalised (norm_topk_prob, megatron: softmax over the top-k
# logits) and not renormalised (megatron: moe_router_pre_softmax).
VARIANTS: dict[str, dict[str, object]] = {
    "norm_topk": {},
    "softmax_topk": {"norm_topk_prob": False},
}
LAYOUTS = {  # (layout, micro-batch rows, router variant)
    # 9 training rows: replica 0 runs 4 (one micro-batch of 4), replica 1 runs 5 (two), so
    # replica 0 adds an all-padding micro-batch that pairs with its peer's all-to-alls.
    "ep2": (ParallelConfig(dp=2, ep=2), 4, "norm_topk"),
    "tp2": (ParallelConfig(tp=2), 8, "softmax_topk"),
    "tp2ep2": (ParallelConfig(tp=2, ep=2), 8, "norm_topk"),
    # MoE stages under 1F1B (3 micro-batches); the stage output crosses over p2p.
    "pp2": (ParallelConfig(pp=2), 4, "norm_topk"),
    # 4 ranks: each stage's experts split over its 2 DP replicas, which run 1 and 2 micro-batches
    # (+ one all-padding) under 1F1B; expert grad norms add up over EP, then over the stages.
    "ep2pp2": (ParallelConfig(pp=2, dp=2, ep=2), 4, "norm_topk"),
}
CACHE = Path.home() / ".cache" / "lockstep-test-models"


def _model(variant: str) -> Path:
    settings = {**zoo.FAMILIES["qwen3_moe"], **VARIANTS[variant]}
    return zoo.ensure_model(f"tiny-qwen3_moe-{variant}", settings, CACHE)


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """The local engine's record of the workload, per router variant (+ its checkpoints)."""
    out: dict[str, dict[str, object]] = {}
    for variant in sorted({v for _, _, v in LAYOUTS.values()}):
        engine = LocalTrainingEngine(_model(variant), "tiny", device="cpu")
        root = tmp_path_factory.mktemp(f"local-{variant}")
        record = run_workload(engine, root)
        for m in TENANTS:
            engine.save_state(m, root / "ckpt" / m, include_optimizer=True)
        record["ckpt"] = root / "ckpt"
        out[variant] = record
    return out


def _shapes(directory: Path, name: str) -> dict[str, tuple[int, ...]]:
    state = checkpoint.read_adapter(directory, name).state
    return {k: tuple(v.shape) for k, v in state.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_local_engine(
    layout: str, references: dict[str, dict[str, object]], tmp_path: Path
) -> None:
    parallel, micro_batch, variant = LAYOUTS[layout]
    model_dir, reference = _model(variant), references[variant]
    engine = MegatronTrainingEngine(
        model_dir, "tiny", parallel, launcher="process", micro_batch=micro_batch
    )
    try:
        got = run_workload(engine, tmp_path)
        for m in TENANTS:
            engine.save_state(m, tmp_path / "ckpt" / m, include_optimizer=True)
    finally:
        engine.close()
    want = {k: v for k, v in reference.items() if k != "ckpt"}
    for key, value in want.items():  # shapes first: the closeness check would broadcast
        assert np.shape(got[key]) == np.shape(value), key
    expert_keys = [k for k in want if ".mlp.experts.w" in k]
    assert len(expert_keys) == 2 * 3 * 2 * len(TENANTS)  # layers x w1/w3/w2 x A/B per tenant
    worst = assert_records_close(got, want)
    print(f"{layout}: worst abs difference {worst:.3g} over {len(want)} values")
    ckpt = reference["ckpt"]
    assert isinstance(ckpt, Path)
    local = LocalTrainingEngine(model_dir, "tiny", device="cpu")
    for m in TENANTS:
        assert _shapes(tmp_path / "ckpt" / m, "tiny") == _shapes(ckpt / m, "tiny")
        local.load_state(m, tmp_path / "ckpt" / m, include_optimizer=True)


def test_unsupported_moe_layouts_are_refused(tmp_path: Path) -> None:
    dense = zoo.ensure_family("qwen3", CACHE)
    with pytest.raises(ValueError, match="--ep 2 needs a mixture-of-experts model"):
        MegatronTrainingEngine(dense, "tiny", ParallelConfig(dp=2, ep=2), launcher="process")
    moe = zoo.ensure_family("qwen3_moe", CACHE)
    with pytest.raises(ValueError, match="--ep 3 must divide the model's 8 experts"):
        MegatronTrainingEngine(moe, "tiny", ParallelConfig(dp=3, ep=3), launcher="process")
    with pytest.raises(ValueError, match="--ep 2 must divide --tp x --dp"):
        MegatronTrainingEngine(moe, "tiny", ParallelConfig(ep=2), launcher="process")
    # Other MoE families (gpt-oss, DeepSeek-V3): tests/megatron/test_refusals.py.


def test_the_adapter_ordinal_rides_the_hidden_states_as_integer_bits() -> None:
    """bf16 holds integers exactly only up to 256: the ordinal is never a bf16 value, its bits
    travel through megatron's permute / all-to-all copies and come back as the same integers."""
    from lockstep.workers.megatron.experts import _tag, _untag

    ordinals = torch.tensor([-1, 0, 1, 255, 256, 257, 1001, 30000])
    perm = torch.randperm(len(ordinals), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.randn(len(ordinals), 4).to(dtype)
        tagged = torch.cat([hidden, _tag(ordinals, dtype).unsqueeze(1)], dim=1)
        assert tagged.isfinite().all()
        moved = tagged.index_select(0, perm)  # what a permute does: copies rows
        assert _untag(moved[:, 4]).tolist() == ordinals[perm].tolist()
