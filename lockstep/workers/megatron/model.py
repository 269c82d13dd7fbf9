"""Build a megatron-core GPTModel (this rank's TP shard of this rank's PP stage) from a HF
Qwen3 / Llama-family config, with the settings that keep fp32 numbers equal to transformers'.

Qwen3-MoE layers become megatron MoE layers: the local spec's SequentialMLP experts (whole
experts, split over EP ranks; never over TP: expert_tensor_parallel_size 1), a frozen softmax
top-k router in fp32, dropless all-to-all dispatch, no load-balancing loss. Other MoE families
(gpt-oss biases and clamped SwiGLU, DeepSeek shared experts and group-limited routing, Qwen3.5
linear attention) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lockstep.engine.shape import ModelShape

# Families the converter is tested on (tests/megatron); what else a model needs is read from
# its Architecture and refused by name where megatron's layers would compute something else.
SUPPORTED = ("qwen3", "llama", "mistral", "qwen2", "qwen3_moe")


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

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @staticmethod
    def from_dir(model_dir: Path) -> HFArch:
        from lockstep.engine.memory import text_config
        from lockstep.modeling.architecture import describe_dir

        return HFArch.from_shape(describe_dir(Path(model_dir)).shape, text_config(Path(model_dir)))

    @staticmethod
    def from_shape(shape: ModelShape, cfg: dict[str, Any]) -> HFArch:
        """Raises ValueError naming what megatron's layers would not compute as the model does."""
        _refuse(shape)
        att = shape.attention()[0]
        ffns = [la.ffn for la in shape.layers if la.ffn is not None]
        moe = next((f for f in ffns if f.routed), None)
        dense = next((f for f in ffns if not f.routed), None)
        rope = cfg.get("rope_parameters") or {}
        assert isinstance(rope, dict)
        return HFArch(
            model_type=shape.family,
            hidden=shape.hidden,
            layers=len(shape.layers),
            heads=att.heads,
            kv_heads=att.kv_heads,
            head_dim=att.head_dim,
            intermediate=dense.width if dense else int(cfg.get("intermediate_size") or 0),
            vocab=shape.vocab,
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            qk_norm=att.qk_norm,
            qkv_bias=att.bias,
            tie_embeddings=shape.tied_embeddings,
            max_positions=int(cfg.get("max_position_embeddings", 2048)),
            experts=moe.experts if moe else 0,
            topk=moe.top_k if moe else 0,
            moe_intermediate=moe.width if moe else 0,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        )


def _refuse(shape: ModelShape) -> None:
    if shape.family not in SUPPORTED:
        raise ValueError(f"the megatron engine converts {SUPPORTED} models, not {shape.family!r}")
    if shape.rope != "default":
        raise ValueError(
            f"the megatron engine supports plain RoPE only (this model's is {shape.rope!r})"
        )
    if any(la.attention is None for la in shape.layers):
        raise ValueError("the megatron engine converts attention layers only")
    window = next((a.window for a in shape.attention() if a.window), None)
    if window:
        raise ValueError(
            f"the megatron engine computes full attention; this model uses a sliding window "
            f"of {window} tokens (serve it with the local engine)"
        )
    ffns = [la.ffn for la in shape.layers]
    routed = [f for f in ffns if f is not None and f.routed]
    if routed and len(routed) != len(ffns):
        raise ValueError(
            "the megatron engine converts MoE models whose every layer is MoE "
            "(mlp_only_layers / decoder_sparse_step mix in dense layers)"
        )
    if any(f.shared_width or f.expert_bias or not f.gated for f in routed):
        raise ValueError(
            "the megatron engine converts gated experts without biases or shared experts"
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
