"""Sampling runs beside the clock: samples complete while a training request is in flight, which
is what lets an async RL loop (rollouts with the last published weights while the next step
trains) overlap the two. Latency while training vs idle is printed; the assertion is the
overlap itself (samples finishing inside the training request's lifetime), not a speed."""

from __future__ import annotations

import statistics
import threading
import time

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e

TINY = types.SamplingParams(max_tokens=1, temperature=1.0)
MIN_TRAIN_S = 2.0  # grow the training request until it lasts at least this long


def _datums(n: int, tokens: int, vocab: int, seed: int) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        seq = rng.integers(0, vocab, tokens + 1).tolist()
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(seq[:-1]),
                loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * tokens},
            )
        )
    return out


def _latency(sampler: tinker.SamplingClient, prompt: types.ModelInput) -> tuple[float, float]:
    """(start, end) of one small sample."""
    start = time.monotonic()
    sampler.sample(prompt=prompt, num_samples=1, sampling_params=TINY).result()
    return start, time.monotonic()


def test_samples_complete_while_the_clock_trains(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=5
    ).result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(trainer.get_tokenizer().encode("rollout:"))
    idle = [end - start for start, end in (_latency(sampler, prompt) for _ in range(5))]

    n = 2
    while True:  # size one training request so that it clearly outlasts a sample
        data = _datums(n, 128, 1000, seed=n)
        start = time.monotonic()
        trainer.forward_backward(data, "cross_entropy").result()
        if time.monotonic() - start >= MIN_TRAIN_S or n >= 512:
            break
        n *= 2

    done = threading.Event()
    window: dict[str, float] = {}

    def train() -> None:
        window["start"] = time.monotonic()
        trainer.forward_backward(data, "cross_entropy").result()
        window["end"] = time.monotonic()
        done.set()

    thread = threading.Thread(target=train)
    thread.start()
    during: list[tuple[float, float]] = []
    while not done.is_set():
        during.append(_latency(sampler, prompt))
    thread.join()
    train_s = window["end"] - window["start"]
    # Samples that started a third into the request and ended before it: by then its cycle
    # was running (the clock gathers for milliseconds, not seconds).
    settled = window["start"] + train_s / 3
    inside = [end - start for start, end in during if start > settled and end < window["end"]]
    print(
        f"train request {train_s:.2f}s ({n} x 128 tokens); sample latency idle median "
        f"{statistics.median(idle):.3f}s, while training median "
        f"{statistics.median(inside or [float('nan')]):.3f}s over {len(inside)} samples"
    )
    # Had the samples waited for the training cycle, none could start and finish inside it.
    assert len(inside) >= 1, (train_s, during)
