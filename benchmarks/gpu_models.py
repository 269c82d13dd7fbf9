"""Production-shaped models for the GPU benchmarks, built in memory from configs (random init, no
download), their FLOPs per training token, and the timing helpers `gpu_suite.py` and
`oom_retry_gpu.py` share.

Shapes (vocabulary, widths, heads and experts as published):
  dense   Qwen3-8B at full depth: 36 layers, hidden 4096, 32/8 heads of 128, MLP 12288, vocab
          151936
  moe     Qwen3-30B-A3B, 8 of its 48 layers (every tenant's LoRA on all 128 experts of 48 layers
          would not fit one GPU beside 8 tenants' Adam state; the suite reports the layer stack's
          MFU apart from the head's): hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8
  hybrid  Qwen3.6-35B-A3B-like (the Qwen3.5-MoE text architecture), 8 layers: hidden 2048, 3
          Gated DeltaNet layers to 1 full-attention layer (16/2 heads of 256), 256 experts of 512,
          top-8, a shared expert of 512, vocab 248320 (widths as the Qwen3.5-35B-A3B config
          publishes them; the layer count is the suite's)
Each has a `smoke` twin (hidden 64, 2 layers) that runs on a CPU in seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lockstep.engine.types import AdamConfig, Datum, OptimRequest, PassRequest
from lockstep.modeling import tiny
from lockstep.modeling.experts import MultiLoRAExperts
from lockstep.modeling.linear_lora import MultiLoRALinear
from lockstep.workers.local.trainer import LocalTrainingEngine

RANK = 32  # every tenant's LoRA rank (attention, MLP / every expert, head)
ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}


@dataclass(frozen=True)
class Shape:
    family: str
    title: str
    model_type: str
    layers: int
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return int(self.settings["vocab_size"])

    def with_layers(self, layers: int) -> Shape:
        settings = dict(self.settings)
        if "layer_types" in settings:  # repeat the pattern over the new depth
            pattern = settings["layer_types"]
            settings["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
        return replace(self, layers=layers, settings=settings)


_HYBRID_LAYERS = (["linear_attention"] * 3 + ["full_attention"]) * 2
SHAPES = {
    "dense": Shape(
        "dense",
        "Qwen3-8B",
        "qwen3",
        36,
        {
            "vocab_size": 151936,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "rope_parameters": ROPE,
        },
    ),
    "moe": Shape(
        "moe",
        "Qwen3-30B-A3B",
        "qwen3_moe",
        8,
        {
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "rope_parameters": ROPE,
        },
    ),
    "hybrid": Shape(
        "hybrid",
        "Qwen3.6-35B-A3B",
        "qwen3_5_moe_text",
        8,
        {
            "vocab_size": 248320,
            "hidden_size": 2048,
            "layer_types": _HYBRID_LAYERS,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_experts": 256,
            "num_experts_per_tok": 8,
        },
    ),
}
_SMOKE = {
    "vocab_size": tiny.TOKENIZER_VOCAB_SIZE,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
SMOKE = {
    "dense": replace(SHAPES["dense"], layers=2, settings={**_SMOKE, "intermediate_size": 128}),
    "moe": replace(
        SHAPES["moe"],
        layers=2,
        settings={
            **SHAPES["moe"].settings,
            **_SMOKE,
            "intermediate_size": 128,
            "moe_intermediate_size": 48,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
    "hybrid": replace(
        SHAPES["hybrid"],
        layers=2,
        settings={
            **SHAPES["hybrid"].settings,
            **_SMOKE,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 48,
            "num_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
}


def build_model(directory: Path, shape: Shape, device: str) -> None:
    """The built-in tokenizer and a random-init bf16 model of `shape` into `directory` (the
    model may have more ids than the tokenizer: token ids are sent, text is never needed)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    eos_id, _ = tiny.write_tokenizer(directory)
    config = AutoConfig.for_model(
        shape.model_type,
        num_hidden_layers=shape.layers,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **shape.settings,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(directory))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def flops_per_token(engine: LocalTrainingEngine, length: int) -> dict[str, float]:
    """Parameters one token passes through (its top-k experts, not all; routers and the head
    included) and the FLOPs of one training token: 4 per frozen base weight (forward + input
    gradient), 6 per LoRA weight (forward + both gradients), plus causal attention over rows of
    `length` tokens (QK^T and AV, forward and backward: 12 * q_dim * length / 2 per layer)."""
    model = engine._model
    config = model.config.get_text_config()
    top_k = int(getattr(config, "num_experts_per_tok", 1) or 1)
    base = lora = 0
    for module in model.modules():
        if isinstance(module, MultiLoRAExperts):
            for slot in module.slots.values():
                base += top_k * slot.in_features * slot.out_features
                lora += top_k * RANK * (slot.in_features + slot.out_features)
        elif isinstance(module, MultiLoRALinear):
            base += module.in_features * module.out_features
            lora += RANK * (module.in_features + module.out_features)
        elif isinstance(module, nn.Linear):  # routers: frozen, never a LoRA target
            base += module.in_features * module.out_features
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    attention = sum(12 * q_dim * length / 2 for t in types if t == "full_attention")
    head = engine._head
    assert isinstance(head, MultiLoRALinear)
    head_flops = 4.0 * head.in_features * head.out_features
    head_flops += 6.0 * RANK * (head.in_features + head.out_features)
    return {
        "active_base_params": float(base),
        "active_lora_params": float(lora),
        "flops_per_token_no_attention": 4.0 * base + 6.0 * lora,
        "flops_per_token": 4.0 * base + 6.0 * lora + attention,
        "flops_per_token_head": head_flops,
    }


def head_seconds(
    engine: LocalTrainingEngine, per: dict[str, list[Datum]], device: str, reps: int
) -> float:
    """Median seconds of what a packed cycle spends in the LM head: every datum's positions
    through the fused head + log-softmax with its tenant's head adapter, forward and backward,
    row by row as the engine calls it, on random final hidden states."""
    from lockstep.training.logprobs import target_logprobs

    dtype = next(engine._model.parameters()).dtype
    hidden = int(engine._model.config.get_text_config().hidden_size)
    rows = []
    for tenant, datums in per.items():
        head = engine._row_head(tenant)
        for d in datums:
            n = len(d.tokens)
            h = torch.randn(n, hidden, device=device, dtype=dtype, requires_grad=True)
            targets = torch.as_tensor(d.loss_inputs["target_tokens"], device=device).view(n, 1)
            rows.append((h, targets, head))

    def run() -> None:
        total = sum(target_logprobs(h, t, head, engine._chunk).sum() for h, t, head in rows)
        assert isinstance(total, torch.Tensor)
        total.backward()

    run()  # warm-up
    times = []
    for _ in range(max(1, reps)):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - start)
    for tenant in per:  # the timed backward's gradients go: the next cycle starts clean
        for p in engine._lora.adapter_parameters(tenant):
            p.grad = None
    return statistics.median(times)


def data(seed: int, vocab: int, datums: int, length: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(datums):
        seq = rng.integers(0, vocab, length + 1, dtype=np.int64)
        out.append(Datum(seq[:-1], {"target_tokens": seq[1:]}))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cycle(
    engine: LocalTrainingEngine,
    per: dict[str, list[Datum]],
    device: str,
    step: bool = True,
    lr: float = 1e-5,
) -> float:
    """Seconds of one clock cycle's engine work: ONE run_passes over every tenant in `per`, then
    ONE optim_step over them."""
    sync(device)
    start = time.perf_counter()
    engine.run_passes([PassRequest(t, t, "cross_entropy", {}, False, d) for t, d in per.items()])
    if step:
        engine.optim_step([OptimRequest(t, AdamConfig(learning_rate=lr)) for t in per])
    sync(device)
    return time.perf_counter() - start


def forward_logprobs(engine: LocalTrainingEngine, per: dict[str, list[Datum]]) -> np.ndarray:
    """Every datum's target logprobs from one forward-only pass, concatenated."""
    outs = engine.run_passes(
        [PassRequest(t, t, "cross_entropy", {}, True, d) for t, d in per.items()]
    )
    return np.concatenate([np.asarray(o["logprobs"]) for r in outs for o in r.outputs])


def admission(
    engine: LocalTrainingEngine, per: dict[str, list[Datum]], length: int, device: str
) -> dict[str, Any]:
    """The admission formula's cost of one packed pass vs the peak it really takes (CUDA)."""
    from lockstep.engine import memory

    budget = engine.memory_budget()
    element = next(engine._model.parameters()).element_size()
    shape = engine._lora.arch.shape
    cost = memory.PassCost.from_shape(shape, element, False, engine._budget, engine._chunk, False)
    out: dict[str, Any] = {
        "budget_bytes": budget.budget_bytes,
        "max_row_tokens": budget.max_row_tokens,
        "formula_pass_bytes": cost.pass_bytes(length),
    }
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        cycle(engine, per, device, step=False)
        out["measured_pass_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        for t in per:  # the pass's gradients go: the next cycle starts clean
            for p in engine._lora.adapter_parameters(t):
                p.grad = None
    return out


def profile_cycle(engine: LocalTrainingEngine, per: dict[str, list[Datum]], device: str) -> str:
    """The top operators of one packed cycle by self device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        cycle(engine, per, device)
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    return str(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def matmul_rate(device: str) -> float:
    """Measured bf16 matmul FLOP/s (8192^3 on CUDA; the MFU denominators use it)."""
    n = 8192 if device == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    reps = 20 if device == "cuda" else 3
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    sync(device)
    return reps * 2 * n**3 / (time.perf_counter() - start)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy, bytes read + written per second."""
    n = (1 << 30) if device == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 10 if device == "cuda" else 2
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return reps * 2 * n / (time.perf_counter() - start)


def peak_gb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 1024**3 if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
