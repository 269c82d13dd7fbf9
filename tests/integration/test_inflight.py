"""Inflight sampling clients through the real SDK, as `tinker.types.SamplingClientKind` documents
them: one mutable weights target per training model, shared by all its inflight clients."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e

GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def _fingerprint(client: tinker.SamplingClient, prompt: types.ModelInput) -> np.ndarray:
    """Greedy tokens' logprobs: which weights served the sample."""
    seq = client.sample(prompt=prompt, num_samples=1, sampling_params=GREEDY).result().sequences[0]
    assert seq.logprobs is not None and len(seq.logprobs) == GREEDY.max_tokens
    return np.array([*seq.tokens, *seq.logprobs], dtype=np.float64)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.allclose(a, b, atol=1e-4, rtol=0))


def _train_step(trainer: tinker.TrainingClient, tokens: list[int]) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    fb = trainer.forward_backward([datum], "cross_entropy")
    opt = trainer.optim_step(types.AdamParams(learning_rate=5e-2))
    fb.result()
    opt.result()


def test_inflight_example_from_the_sdk(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    run_inflight_example(service_client, base_model)


def run_inflight_example(service_client: tinker.ServiceClient, base_model: str) -> None:
    """Publish W1 -> client A; train; publish W2 -> client B: B samples W2, A samples W2 once it
    is published (at once after W2 served a sample: within one publish), a snapshot keeps W1.
    Shared with the vLLM sampler's tests."""
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=7
    ).result()
    tokenizer = trainer.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("The inflight weights say:"))
    _train_step(trainer, tokenizer.encode("one two three four five six seven"))

    client_a = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_1 = trainer.save_weights_and_get_sampling_client().result()
    w1 = _fingerprint(snapshot_1, prompt)
    assert _same(_fingerprint(client_a, prompt), w1), "A must start on W1"

    for _ in range(3):
        _train_step(trainer, tokenizer.encode("zebra quantum violet harbor"))

    client_b = trainer.save_weights_and_get_sampling_client(kind="inflight").result()
    assert client_b._sampling_session_id != client_a._sampling_session_id  # own KV namespace
    w2_from_b = _fingerprint(client_b, prompt)  # may be the first sample to need W2
    snapshot_2 = trainer.save_weights_and_get_sampling_client().result()
    w2 = _fingerprint(snapshot_2, prompt)
    assert not _same(w1, w2), "training did not change the weights; the test proves nothing"
    assert _same(w2_from_b, w2), "B must never sample weights older than W2"
    assert _same(_fingerprint(client_a, prompt), w2), "A adopts W2 once it is served"
    assert _same(_fingerprint(snapshot_1, prompt), w1), "a snapshot client keeps W1"


def test_inflight_client_of_an_older_save_never_goes_back(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    """Two training models: each has its own target; a newer save of one does not move the
    other's clients, and a target only moves forward."""
    first = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=11
    ).result()
    second = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=12
    ).result()
    tokenizer = first.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("Two tenants:"))
    _train_step(first, tokenizer.encode("alpha beta gamma delta"))
    _train_step(second, tokenizer.encode("red green blue yellow"))
    first_inflight = first.save_weights_and_get_sampling_client(kind="inflight").result()
    first_w = _fingerprint(first.save_weights_and_get_sampling_client().result(), prompt)
    second.save_weights_and_get_sampling_client(kind="inflight").result()
    for _ in range(2):
        _train_step(second, tokenizer.encode("red green blue yellow"))
    second_inflight = second.save_weights_and_get_sampling_client(kind="inflight").result()
    second_w = _fingerprint(second.save_weights_and_get_sampling_client().result(), prompt)
    assert _same(_fingerprint(second_inflight, prompt), second_w)
    assert _same(_fingerprint(first_inflight, prompt), first_w), "another model's save moved it"
