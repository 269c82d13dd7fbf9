"""The sampler sections of `gpu_suite.py`: the local sampler (`LocalSamplingEngine`) on a model
directory, with one adapter the trainer exported: 8 requests x 4 seeded samples, every sample
runs to max_tokens (no stop); generated tokens per second of each way it can run:

  eager_fp32     today's default before the GPU path: fp32 weights, a growing KV cache
  eager_auto     `--sampler-dtype auto` (bf16 weights on CUDA; fp32 on a CPU), eager decode
  static_auto    ...and `--sampler-decode static`: a fixed-capacity KV cache, the step replayed
                 as a CUDA graph where the model allows it (`capabilities` says)

Every variant samples the same requests; `static_auto` is compared with `eager_auto` (same
weights): the share of sequences with identical tokens and the largest logprob difference over
the tokens they share (bf16 on a GPU moves a near-tie now and then; fp32 on a CPU must be 1.0 and
~1e-6). `tokens_per_s` (top level) stays today's number; `speedup` = static_auto / eager_fp32.
On a CPU the numbers only show that the script works: the target is a GPU's.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_models import sync

from lockstep.config.sections import SamplerDecode
from lockstep.config.training import DtypeName
from lockstep.engine.types import SampleParams, SampleRequest, SampleResult
from lockstep.rollout.local.sampler import LocalSamplingEngine

REQUESTS, SAMPLES = 8, 4
VARIANTS: dict[str, tuple[DtypeName | None, SamplerDecode]] = {
    "eager_fp32": ("float32", "eager"),
    "eager_auto": (None, "eager"),
    "static_auto": (None, "static"),
}


def sample_throughput(
    device: str,
    directory: Path,
    title: str,
    vocab: int,
    adapter: Path | None,
    new_tokens: int,
    prompt_tokens: int,
    reps: int,
) -> dict[str, Any]:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(REQUESTS)]
    adapter_id = None if adapter is None else "t0"

    def requests(n: int, tokens: int) -> list[SampleRequest]:
        params = SampleParams(max_tokens=tokens, seed=1, stop_at_eos=False)
        return [
            SampleRequest(f"r{i}", adapter_id, p, SAMPLES, params)
            for i, p in enumerate(prompts[:n])
        ]

    variants: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[SampleResult]] = {}
    for name, (dtype, decode) in VARIANTS.items():
        engine = LocalSamplingEngine(directory, title, device=device, dtype=dtype, decode=decode)
        try:
            if adapter is not None:
                engine.load_adapter("t0", adapter)
            engine.sample(requests(2, 4))  # warm-up
            times: list[float] = []
            for _ in range(reps):
                batch = requests(REQUESTS, new_tokens)
                sync(device)
                start = time.perf_counter()
                outputs[name] = engine.sample(batch)
                sync(device)
                times.append(time.perf_counter() - start)
            caps = engine.capabilities()
            generated = sum(len(s.tokens) for r in outputs[name] for s in r.sequences)
            variants[name] = {
                "dtype": caps.dtype,
                "decode": caps.decode,
                "decode_fallback": caps.decode_fallback,
                "cuda_graphs": caps.cuda_graphs,
                "graph_failure": engine.graph_failure(),
                "generated_tokens": generated,
                "s": times,
                "tokens_per_s": generated / statistics.median(times),
            }
        finally:
            engine.close()
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    today = variants["eager_fp32"]
    return {
        "dtype": "float32",
        "requests": REQUESTS,
        "samples_per_request": SAMPLES,
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "generated_tokens": today["generated_tokens"],
        "with_adapter": adapter_id is not None,
        "s": today["s"],
        "tokens_per_s": today["tokens_per_s"],
        "variants": variants,
        "speedup": variants["static_auto"]["tokens_per_s"] / today["tokens_per_s"],
        "static_vs_eager": agreement(outputs["static_auto"], outputs["eager_auto"]),
    }


def agreement(got: list[SampleResult], want: list[SampleResult]) -> dict[str, float]:
    """Share of sequences with identical tokens; largest logprob difference over the tokens
    two sequences share before they first differ."""
    same, total, worst = 0, 0, 0.0
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.sequences, w.sequences, strict=True):
            total += 1
            same += a.tokens == b.tokens
            shared = next(
                (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
                len(a.tokens),
            )
            pairs = zip(a.logprobs[:shared], b.logprobs[:shared], strict=False)
            diffs = [abs(x - y) for x, y in pairs]
            worst = max([worst, *diffs])
    return {"same_tokens_share": same / max(1, total), "max_abs_logprob_diff": worst}


def decode_roofline(
    directory: Path, sequences: int, context: float, bandwidth: float
) -> dict[str, float]:
    """The decode rate the HBM allows at `sequences` in flight: every step reads every weight
    once (bf16 as saved; a MoE's experts all counted: at 32 sequences x top-8 nearly every expert
    is touched) and every sequence's K/V of its full-attention layers at `context` positions;
    generated tokens/s = sequences / (bytes per step / the measured copy bandwidth)."""
    from transformers import AutoConfig

    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    config = AutoConfig.from_pretrained(directory).get_text_config()
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    full = sum(1 for t in types if t == "full_attention")
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", 0) or config.hidden_size // heads)
    kv = full * 2 * int(config.num_key_value_heads) * head_dim * 2 * context * sequences
    step = weights + kv
    return {
        "weight_bytes_per_step": float(weights),
        "kv_bytes_per_step": float(kv),
        "roofline_tokens_per_s": sequences * bandwidth / step,
    }
