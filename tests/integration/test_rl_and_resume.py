"""An RL loop through the real SDK, and save_state / resume with and without the optimizer."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data

pytestmark = pytest.mark.e2e


def test_rl_loop_raises_reward_and_logprobs_agree(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    """Parity bandit: reward 1 when the sampled token id is even (baseline about 0.5).

    Sampling is seeded (per step and prompt): unseeded, a slow-learning draw now and then ended
    below the bar (0.70 once in CI). Seeded, 12 different seed bases all ended at 0.79-1.0."""
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=16, seed=1
    ).result()
    tokenizer = trainer.get_tokenizer()
    prompts = [tokenizer.encode(f"pick {i}:") for i in range(8)]
    rewards_per_step = []
    for step in range(16):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(p),
                num_samples=8,
                sampling_params=types.SamplingParams(
                    max_tokens=1, temperature=1.0, seed=step * 100 + i
                ),
            )
            for i, p in enumerate(prompts)
        ]
        data, sampler_lps, step_rewards = [], [], []
        for prompt, fut in zip(prompts, futures, strict=True):
            seqs = fut.result().sequences
            rewards = np.array([float(s.tokens[0] % 2 == 0) for s in seqs])
            step_rewards.extend(rewards)
            advantages = rewards - rewards.mean()
            for seq, adv in zip(seqs, advantages, strict=True):
                assert seq.logprobs is not None and len(seq.logprobs) == 1
                n = len(prompt)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(prompt),
                        loss_fn_inputs={
                            "target_tokens": prompt[1:] + [seq.tokens[0]],
                            "logprobs": [0.0] * (n - 1) + [seq.logprobs[0]],
                            "advantages": [0.0] * (n - 1) + [float(adv)],
                        },
                    )
                )
                sampler_lps.append(seq.logprobs[0])
        fb = trainer.forward_backward(data, "importance_sampling")
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-2))
        result = fb.result()
        opt.result()
        trainer_lps = [out["logprobs"].to_numpy()[-1] for out in result.loss_fn_outputs]
        np.testing.assert_allclose(trainer_lps, sampler_lps, atol=1e-4)
        rewards_per_step.append(float(np.mean(step_rewards)))
    start, end = np.mean(rewards_per_step[:3]), np.mean(rewards_per_step[-3:])
    assert end >= start + 0.2 and end >= 0.75, rewards_per_step


def _steps(trainer: tinker.TrainingClient, data: list[types.Datum], n: int) -> list[float]:
    losses = []
    for _ in range(n):
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


# TrainingClient.load_state* is deprecated in the SDK but still shipped: users call it, so this
# test calls it on purpose (the SDK warns each time).
@pytest.mark.filterwarnings("ignore:DEPRECATED. TrainingClient.load_state:FutureWarning")
def test_resume_with_and_without_optimizer(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    run_a = service_client.create_lora_training_client(
        base_model=base_model, rank=8, seed=123
    ).result()
    data = quickstart_data(run_a.get_tokenizer())
    _steps(run_a, data, 3)
    path = run_a.save_state("mid").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/mid")
    a = _steps(run_a, data, 3)

    run_b = service_client.create_training_client_from_state_with_optimizer(path).result()
    b = _steps(run_b, data, 3)
    np.testing.assert_allclose(b, a, rtol=1e-5)

    run_c = service_client.create_training_client_from_state(path).result()
    c = _steps(run_c, data, 3)
    assert c[0] == pytest.approx(a[0], rel=1e-5)  # same weights
    assert abs(c[1] - a[1]) > 10 * abs(b[1] - a[1]) + 1e-6  # but a fresh Adam

    # load_state on a running model, in its seq order, also restores the optimizer.
    run_b.load_state_with_optimizer(path).result()
    np.testing.assert_allclose(_steps(run_b, data, 2), a[:2], rtol=1e-5)


def test_named_sampler_checkpoint_serves_the_trainer_weights(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=7
    ).result()
    data = quickstart_data(trainer.get_tokenizer())
    _steps(trainer, data, 2)
    path = trainer.save_weights_for_sampler("s1").result().path
    assert path.endswith("/sampler_weights/s1")
    sampler = service_client.create_sampling_client(model_path=path).result()
    tokens = data[0].model_input.to_ints()
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    fwd = trainer.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:]},
            )
        ],
        "cross_entropy",
    ).result()
    np.testing.assert_allclose(
        np.array(lps[1:], dtype=np.float32),
        fwd.loss_fn_outputs[0]["logprobs"].to_numpy(),
        atol=1e-4,
    )
