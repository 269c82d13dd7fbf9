"""HF <-> megatron conversion per (TP rank, PP stage) round-trips bit for bit, and the LoRA
merge rules rebuild full adapters from TP shards. Pure tensor code: no processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lockstep.modeling import zoo
from lockstep.modeling.tiny import ensure_default_model
from lockstep.workers.megatron.convert import fuse_qkv, hf_to_megatron, megatron_to_hf
from lockstep.workers.megatron.lora import ParamInfo, merge_shards
from lockstep.workers.megatron.model import HFArch


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(Path.home() / ".cache" / "lockstep-test-models")


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_shards_round_trip(model_dir: Path, tp: int, pp: int) -> None:
    arch = HFArch.from_dir(model_dir)
    hf = load_file(str(model_dir / "model.safetensors"))
    back: dict[str, torch.Tensor] = {}
    for stage in range(pp):
        shards = [hf_to_megatron(hf, arch, tp, r, pp, stage) for r in range(tp)]
        if tp > 1:  # a TP shard really is a part: half the columns of the fused QKV
            key = "decoder.layers.0.self_attention.linear_qkv.weight"
            assert shards[0][key].shape[0] * tp == (arch.heads + 2 * arch.kv_heads) * arch.head_dim
        back |= megatron_to_hf(shards, arch, pp, stage)
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_moe_shards_round_trip(tp: int, ep: int) -> None:
    """Qwen3-MoE: the router is replicated, EP rank r holds experts [r*E/ep, (r+1)*E/ep) whole."""
    model_dir = zoo.ensure_family("qwen3_moe", Path.home() / ".cache" / "lockstep-test-models")
    arch = HFArch.from_dir(model_dir)
    assert (arch.experts, arch.topk, arch.moe_intermediate, arch.qk_norm) == (8, 2, 48, True)
    hf = load_file(str(model_dir / "model.safetensors"))
    shards = [hf_to_megatron(hf, arch, tp, r, 1, 0, ep, 0) for r in range(tp)]
    by_ep = [hf_to_megatron(hf, arch, tp, 0, 1, 0, ep, r) for r in range(ep)]
    experts = [k for k in by_ep[-1] if ".local_experts." in k]
    assert len(experts) == arch.layers * 2 * arch.experts // ep
    back = megatron_to_hf(shards, arch, 1, 0, by_ep)
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key


def test_qkv_layout_is_grouped(model_dir: Path) -> None:
    """Per KV group: that group's query heads, then its key head, then its value head."""
    arch = HFArch.from_dir(model_dir)
    d = arch.head_dim
    q = torch.arange(arch.heads * d).float()[:, None]
    k = 1000 + torch.arange(arch.kv_heads * d).float()[:, None]
    v = 2000 + torch.arange(arch.kv_heads * d).float()[:, None]
    fused = fuse_qkv(arch, q, k, v)[:, 0]
    per_group = arch.heads // arch.kv_heads
    group0 = fused[: (per_group + 2) * d]
    assert torch.equal(group0[: per_group * d], q[: per_group * d, 0])
    assert torch.equal(group0[per_group * d : (per_group + 1) * d], k[:d, 0])
    assert torch.equal(group0[(per_group + 1) * d :], v[:d, 0])


def test_lora_shards_merge() -> None:
    a_full, b_full = torch.randn(4, 8), torch.randn(6, 4)
    shards = [
        [(a_full, ParamInfo("a", None)), (chunk, ParamInfo("b", 0))]
        for chunk in torch.chunk(b_full, 2, dim=0)
    ]
    merged = merge_shards(shards)
    assert torch.equal(merged["a"], a_full) and torch.equal(merged["b"], b_full)
