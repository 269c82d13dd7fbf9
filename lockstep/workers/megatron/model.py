"""Build a megatron-core GPTModel (this rank's TP shard of this rank's PP stage) from a HF
Llama-family config, with the settings that keep fp32 numbers equal to transformers'.

What megatron's layers compute is decided from the model's shape (`engine.shape.ModelShape`,
built once by `modeling.architecture`): sliding windows become megatron's `window_size` (one size,
per-layer on/off), Qwen3-MoE layers megatron MoE layers (the local spec's SequentialMLP experts,
whole experts split over EP ranks, never over TP; a frozen softmax top-k router in fp32, dropless
all-to-all dispatch, no load-balancing loss). Every feature whose numbers megatron's layers would
not reproduce is refused by name, all of a model's at once (`support.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.engine.families import ModelConfig
from lockstep.engine.shape import ModelShape
from lockstep.workers.megatron.support import UnsupportedByMegatron, refused_features


@dataclass(frozen=True)
class HFArch:
    """What the conversion needs: the model's shape (`modeling.architecture`) and the numbers
    of its config.json."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    qkv_bias: bool  # Qwen2
    tie_embeddings: bool
    max_positions: int
    experts: int = 0  # routed experts per MoE layer (0: dense MLP)
    topk: int = 0  # experts per token
    moe_intermediate: int = 0
    norm_topk_prob: bool = True  # top-k weights renormalised to sum to 1
    window: int = 0  # sliding window: tokens a query sees, itself included (0: none)
    windowed: tuple[bool, ...] = ()  # per layer: whether it uses the window

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @staticmethod
    def from_dir(model_dir: Path) -> HFArch:
        from lockstep.modeling.architecture import describe_dir

        text = ModelConfig.read(model_dir).text
        return HFArch.from_shape(describe_dir(Path(model_dir)).shape, text)

    @staticmethod
    def from_shape(shape: ModelShape, cfg: dict[str, Any]) -> HFArch:
        """Raises UnsupportedByMegatron naming every feature megatron would compute otherwise."""
        found = refused_features(shape)
        if found:
            raise UnsupportedByMegatron(shape.family, found)
        att = shape.attention()
        ffns = [la.ffn for la in shape.layers if la.ffn is not None]
        moe = next((f for f in ffns if f.routed), None)
        dense = next((f for f in ffns if not f.routed), None)
        rope = cfg.get("rope_parameters") or {}
        assert isinstance(rope, dict)
        return HFArch(
            model_type=shape.family,
            hidden=shape.hidden,
            layers=len(shape.layers),
            heads=att[0].heads,
            kv_heads=att[0].kv_heads,
            head_dim=att[0].head_dim,
            intermediate=dense.width if dense else int(cfg.get("intermediate_size") or 0),
            vocab=shape.vocab,
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            qk_norm=att[0].qk_norm,
            qkv_bias=att[0].bias,
            tie_embeddings=shape.tied_embeddings,
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            experts=moe.experts if moe else 0,
            topk=moe.top_k if moe else 0,
            moe_intermediate=moe.width if moe else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            window=max((a.window or 0 for a in att), default=0),
            windowed=tuple(bool(a.window) for a in att),
        )


def _window_settings(arch: HFArch) -> dict[str, Any]:
    """HF's window W: a query sees itself and the W - 1 keys before it. megatron's
    `window_size=(left, right)` keeps keys i - left .. i + right (local spec: masked softmax),
    switched on per layer by `window_attn_skip_freq` (1 = windowed, by global layer number)."""
    if not arch.window:
        return {}
    return {
        "window_size": (arch.window - 1, 0),
        "window_attn_skip_freq": [int(w) for w in arch.windowed],
    }


def _moe_settings(arch: HFArch, ep: int) -> dict[str, Any]:
    if not arch.moe:
        return {}
    return {
        "num_moe_experts": arch.experts,
        "moe_router_topk": arch.topk,
        "moe_ffn_hidden_size": arch.moe_intermediate,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": 1,  # whole experts: TP ranks split the tokens instead
        # HF: softmax over all experts, top-k, then renormalise if norm_topk_prob. megatron:
        # top-k of the logits then softmax over them == renormalised; pre-softmax == not.
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_dtype": "fp32",
        # Dropless, and the router is frozen: no capacity, no balancing loss.
        "moe_token_dispatcher_type": "alltoall",
        "moe_expert_capacity_factor": None,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
    }


def transformer_config(
    arch: HFArch, tp: int, pp: int, cp: int = 1, sequence_parallel: bool = False, ep: int = 1
) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **_moe_settings(arch, ep),
        **_window_settings(arch),
        num_layers=arch.layers,
        hidden_size=arch.hidden,
        ffn_hidden_size=arch.intermediate,
        num_attention_heads=arch.heads,
        num_query_groups=arch.kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.eps,
        qk_layernorm=arch.qk_norm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        # Fused CUDA kernels off: the same code runs on CPU and GPU, in plain fp32.
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Losses are token sums (Tinker's convention): the schedule must not average them.
        calculate_per_token_loss=True,
        # gloo has no batched isend/irecv.
        batch_p2p_comm=torch.cuda.is_available(),
    )


def build_stage(
    arch: HFArch, tp: int, pp: int, cp: int = 1, sequence_parallel: bool = False, ep: int = 1
) -> Any:
    """This rank's GPTModel: embedding on the first stage, norm + LM head on the last; logits are
    stay split over TP (parallel_output=True): the last stage computes logprobs vocab-parallel."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = transformer_config(arch, tp, pp, cp, sequence_parallel, ep)
    spec = get_gpt_layer_local_spec(
        num_experts=arch.experts or None,
        moe_grouped_gemm=False,
        qk_layernorm=arch.qk_norm,
        normalization="RMSNorm",
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab,
        max_sequence_length=arch.max_positions,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(arch.rope_theta),
    )
    model.eval()  # no dropout anywhere; gradients flow only into the adapters
    for p in model.parameters():
        p.requires_grad_(False)
    return model
