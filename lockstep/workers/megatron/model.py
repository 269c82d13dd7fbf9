"""Build a megatron-core GPTModel (this rank's TP shard of this rank's PP stage) from a HF
Qwen3 / Llama-family config, with the settings that keep fp32 numbers equal to transformers'.

Qwen3-MoE layers become megatron MoE layers: the local spec's SequentialMLP experts (whole
experts, split over EP ranks; never over TP: expert_tensor_parallel_size 1), a frozen softmax
top-k router in fp32, dropless all-to-all dispatch, no load-balancing loss. Other MoE families
(gpt-oss biases and clamped SwiGLU, DeepSeek shared experts and group-limited routing, Qwen3.5
linear attention) are refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED = ("qwen3", "llama", "mistral", "qwen2", "qwen3_moe")
MOE = ("qwen3_moe",)


@dataclass(frozen=True)
class HFArch:
    """What the conversion needs from config.json."""

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

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @staticmethod
    def from_dir(model_dir: Path) -> HFArch:
        cfg: dict[str, Any] = json.loads((Path(model_dir) / "config.json").read_text())
        model_type = str(cfg.get("model_type"))
        if model_type not in SUPPORTED:
            raise ValueError(f"the megatron engine converts {SUPPORTED} models, not {model_type!r}")
        if (
            cfg.get("rope_scaling")
            or (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default"
        ):
            raise ValueError("the megatron engine supports plain RoPE only (no rope scaling)")
        window = cfg.get("sliding_window")
        if window and (model_type != "qwen2" or cfg.get("use_sliding_window")):
            raise ValueError(
                f"the megatron engine computes full attention; this model uses a sliding window "
                f"of {window} tokens (serve it with the local engine)"
            )
        heads = int(cfg["num_attention_heads"])
        experts = 0
        if model_type in MOE:
            experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
            if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
                raise ValueError(
                    "the megatron engine converts Qwen3-MoE models whose every layer is MoE "
                    "(mlp_only_layers / decoder_sparse_step mix in dense layers)"
                )
        rope = cfg.get("rope_parameters") or {}
        return HFArch(
            model_type=model_type,
            hidden=int(cfg["hidden_size"]),
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            qkv_bias=model_type == "qwen2",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            experts=experts,
            topk=int(cfg.get("num_experts_per_tok", 0)) if experts else 0,
            moe_intermediate=int(cfg.get("moe_intermediate_size", 0)) if experts else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )


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
