"""HF Qwen3 / Llama state dict <-> megatron GPTModel state dict, one TP/PP shard at a time.

Layouts megatron uses (local spec):
- `linear_qkv`: fused, per query group: [q heads of the group, k head, v head] rows; TP splits
  whole groups, so a shard is a contiguous chunk of the fused matrix.
- `linear_fc1`: [gate; up], and each TP shard is [gate shard; up shard] (SwiGLU chunks locally).
- `linear_proj` / `linear_fc2` / embeddings / LM head: plain row or column chunks.
- Norms (input, pre-MLP, q/k, final) are replicated.
- MoE (Qwen3-MoE): `mlp.router.weight` (HF `mlp.gate`) replicated; EP rank r holds experts
  [r*E/ep, (r+1)*E/ep) whole (no TP split) as `mlp.experts.local_experts.<i>.linear_fc1`
  ([gate; up]) and `linear_fc2` (down).
"""

from __future__ import annotations

import torch

from lockstep.workers.megatron.model import HFArch

Tensor = torch.Tensor


def stage_layers(arch: HFArch, pp: int, pp_rank: int) -> range:
    """Global layer indices held by pipeline stage `pp_rank` (uniform split)."""
    per = arch.layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def fuse_qkv(arch: HFArch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """HF q/k/v (rows = heads * head_dim, first dim) -> megatron's grouped layout."""
    groups, per_group = arch.kv_heads, arch.heads // arch.kv_heads
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * arch.head_dim, *rest)
    k = k.reshape(groups, arch.head_dim, *rest)
    v = v.reshape(groups, arch.head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(arch: HFArch, fused: Tensor, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv` for a tensor holding `groups` query groups."""
    per_group = arch.heads // arch.kv_heads
    rest = fused.shape[1:]
    g = fused.reshape(groups, (per_group + 2) * arch.head_dim, *rest)
    q, k, v = torch.split(g, [per_group * arch.head_dim, arch.head_dim, arch.head_dim], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def _chunk(t: Tensor, tp: int, rank: int, dim: int = 0) -> Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].contiguous()


def local_experts(arch: HFArch, ep: int, ep_rank: int) -> range:
    """Global indices of the experts EP rank `ep_rank` holds (contiguous, as megatron's)."""
    per = arch.experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def hf_to_megatron(
    hf: dict[str, Tensor],
    arch: HFArch,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, Tensor]:
    """The megatron state dict of one (TP rank, PP stage, EP rank) shard."""
    out: dict[str, Tensor] = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = _chunk(
            hf["model.embed_tokens.weight"], tp, tp_rank
        )
    for local, layer in enumerate(stage_layers(arch, pp, pp_rank)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{local}."
        att = src + "self_attn."
        qkv = fuse_qkv(
            arch, hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"]
        )
        out[dst + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp, tp_rank)
        if arch.qkv_bias:
            bias = fuse_qkv(
                arch, hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"]
            )
            out[dst + "self_attention.linear_qkv.bias"] = _chunk(bias, tp, tp_rank)
        out[dst + "self_attention.linear_proj.weight"] = _chunk(
            hf[att + "o_proj.weight"], tp, tp_rank, dim=1
        )
        if arch.qk_norm:
            out[dst + "self_attention.q_layernorm.weight"] = hf[att + "q_norm.weight"]
            out[dst + "self_attention.k_layernorm.weight"] = hf[att + "k_norm.weight"]
        # The local spec keeps the pre-attention / pre-MLP norms as their own modules.
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        if arch.moe:
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
            for i, e in enumerate(local_experts(arch, ep, ep_rank)):
                hf_e, mg_e = f"{src}mlp.experts.{e}.", f"{dst}mlp.experts.local_experts.{i}."
                out[mg_e + "linear_fc1.weight"] = torch.cat(
                    [hf[hf_e + "gate_proj.weight"], hf[hf_e + "up_proj.weight"]]
                )
                out[mg_e + "linear_fc2.weight"] = hf[hf_e + "down_proj.weight"]
            continue
        gate = _chunk(hf[src + "mlp.gate_proj.weight"], tp, tp_rank)
        up = _chunk(hf[src + "mlp.up_proj.weight"], tp, tp_rank)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up])
        out[dst + "mlp.linear_fc2.weight"] = _chunk(
            hf[src + "mlp.down_proj.weight"], tp, tp_rank, dim=1
        )
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        head = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
        out["output_layer.weight"] = _chunk(head, tp, tp_rank)
    return out


def megatron_to_hf(
    shards: list[dict[str, Tensor]],
    arch: HFArch,
    pp: int,
    pp_rank: int,
    expert_shards: list[dict[str, Tensor]] | None = None,
) -> dict[str, Tensor]:
    """Merge the TP shards (in TP-rank order) of one PP stage back into HF tensors; MoE experts
    come from `expert_shards`, one state dict per EP rank in EP-rank order (default: shards[0])."""
    tp = len(shards)
    by_ep = expert_shards or shards[:1]

    def cat(key: str, dim: int = 0) -> Tensor:
        return torch.cat([s[key] for s in shards], dim=dim)

    out: dict[str, Tensor] = {}
    if pp_rank == 0:
        out["model.embed_tokens.weight"] = cat("embedding.word_embeddings.weight")
    for local, layer in enumerate(stage_layers(arch, pp, pp_rank)):
        src, dst = f"decoder.layers.{local}.", f"model.layers.{layer}."
        att = dst + "self_attn."
        parts = [
            split_qkv(arch, s[src + "self_attention.linear_qkv.weight"], arch.kv_heads // tp)
            for s in shards
        ]
        for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[att + f"{name}.weight"] = torch.cat([p[i] for p in parts])
        out[att + "o_proj.weight"] = cat(src + "self_attention.linear_proj.weight", dim=1)
        if arch.qk_norm:
            out[att + "q_norm.weight"] = shards[0][src + "self_attention.q_layernorm.weight"]
            out[att + "k_norm.weight"] = shards[0][src + "self_attention.k_layernorm.weight"]
        out[dst + "input_layernorm.weight"] = shards[0][src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = shards[0][src + "pre_mlp_layernorm.weight"]
        if arch.moe:
            out[dst + "mlp.gate.weight"] = shards[0][src + "mlp.router.weight"]
            for r, part in enumerate(by_ep):
                for i, e in enumerate(local_experts(arch, len(by_ep), r)):
                    mg_e, hf_e = f"{src}mlp.experts.local_experts.{i}.", f"{dst}mlp.experts.{e}."
                    gate, up = torch.chunk(part[mg_e + "linear_fc1.weight"], 2)
                    out[hf_e + "gate_proj.weight"] = gate
                    out[hf_e + "up_proj.weight"] = up
                    out[hf_e + "down_proj.weight"] = part[mg_e + "linear_fc2.weight"]
            continue
        halves = [torch.chunk(s[src + "mlp.linear_fc1.weight"], 2) for s in shards]
        out[dst + "mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves])
        out[dst + "mlp.up_proj.weight"] = torch.cat([h[1] for h in halves])
        out[dst + "mlp.down_proj.weight"] = cat(src + "mlp.linear_fc2.weight", dim=1)
    if pp_rank == pp - 1:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"]
        if not arch.tie_embeddings:
            out["lm_head.weight"] = cat("output_layer.weight")
    return out


def load_stage(
    model: torch.nn.Module,
    hf: dict[str, Tensor],
    arch: HFArch,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    ep: int = 1,
    ep_rank: int = 0,
) -> None:
    """Copy the converted shard into `model`; every real parameter must be covered."""
    state = hf_to_megatron(hf, arch, tp, tp_rank, pp, pp_rank, ep, ep_rank)
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"weight conversion mismatch: missing {missing[:4]}, "
            f"unexpected {result.unexpected_keys[:4]}"
        )
