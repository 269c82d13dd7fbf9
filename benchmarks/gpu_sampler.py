"""The sampler section of `gpu_suite.py`: today's local sampler (fp32, eager attention,
`LocalSamplingEngine`) on a model directory, with one adapter the trainer exported: 8 requests x
4 samples, every sample runs to max_tokens (no stop); generated tokens per second."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from gpu_models import sync

from lockstep.engine.types import SampleParams, SampleRequest
from lockstep.rollout.local.sampler import LocalSamplingEngine

REQUESTS, SAMPLES = 8, 4


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
    engine = LocalSamplingEngine(directory, title, device=device)
    try:
        adapter_id = None
        if adapter is not None:
            engine.load_adapter("t0", adapter)
            adapter_id = "t0"
        rng = np.random.default_rng(5)

        def requests(n: int, tokens: int) -> list[SampleRequest]:
            params = SampleParams(max_tokens=tokens, seed=1, stop_at_eos=False)
            prompts = [rng.integers(0, vocab, prompt_tokens).tolist() for _ in range(n)]
            return [
                SampleRequest(f"r{i}", adapter_id, p, SAMPLES, params)
                for i, p in enumerate(prompts)
            ]

        engine.sample(requests(2, 4))  # warm-up
        times, generated = [], 0
        for _ in range(reps):
            batch = requests(REQUESTS, new_tokens)
            sync(device)
            start = time.perf_counter()
            results = engine.sample(batch)
            sync(device)
            times.append(time.perf_counter() - start)
            generated = sum(len(s.tokens) for r in results for s in r.sequences)
        return {
            "dtype": "float32",
            "requests": REQUESTS,
            "samples_per_request": SAMPLES,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "generated_tokens": generated,
            "with_adapter": adapter_id is not None,
            "s": times,
            "tokens_per_s": generated / statistics.median(times),
        }
    finally:
        engine.close()
