"""The Tinker docs' Pig Latin quickstart, unmodified but for base_url/model/learning rate."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data

pytestmark = pytest.mark.e2e


def manual_loss(result: types.ForwardBackwardOutput, data: list[types.Datum]) -> float:
    return float(
        sum(
            -(out["logprobs"].to_numpy() * d.loss_fn_inputs["weights"].to_numpy()).sum()
            for out, d in zip(result.loss_fn_outputs, data, strict=True)
        )
    )


def test_pig_latin_trains_and_samples(
    service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=32, seed=0
    ).result()
    tokenizer = trainer.get_tokenizer()
    data = quickstart_data(tokenizer)
    total_weight = sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in data)

    losses = []
    for _ in range(40):
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=5e-3))
        result = fb.result()
        opt.result()
        assert result.metrics["loss:sum"] == pytest.approx(manual_loss(result, data), rel=1e-3)
        assert float(result.metrics["clock_cycle:unique"]).is_integer()
        losses.append(result.metrics["loss:sum"] / total_weight)
    vocab = len(tokenizer)
    assert abs(losses[0] - np.log(vocab)) < 0.3 * np.log(vocab), losses[0]
    assert min(losses) < 0.1 * losses[0], losses

    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt_tokens = tokenizer.encode("English: banana split\nPig Latin:", add_special_tokens=True)
    completion = tokenizer.encode(" anana-bay plit-say\n\n", add_special_tokens=False)
    params = types.SamplingParams(max_tokens=20, temperature=0.0, stop=["\n"])
    out = sampler.sample(
        prompt=types.ModelInput.from_ints(prompt_tokens), num_samples=8, sampling_params=params
    ).result()
    assert len(out.sequences) == 8
    first = out.sequences[0].tokens
    assert all(s.tokens == first for s in out.sequences), "greedy samples differ"
    assert out.sequences[0].stop_reason == "stop"
    assert first == completion[: len(first)], (tokenizer.decode(first), completion)
    assert tokenizer.decode(first).startswith(" anana-bay plit-say\n")
    assert len(first) <= 20

    # compute_logprobs (sampler) equals the trainer's forward logprobs on the same tokens.
    full = prompt_tokens + completion
    sampled_lp = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert len(sampled_lp) == len(full) and sampled_lp[0] is None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:]},
    )
    fwd = trainer.forward([datum], "cross_entropy").result()
    trainer_lp = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(np.array(sampled_lp[1:], dtype=np.float32), trainer_lp, atol=1e-4)

    # top-k prompt logprobs: sorted, <= 0, and the top-1 is at least the actual token's logprob.
    res = sampler.sample(
        prompt=types.ModelInput.from_ints(full),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=5,
    ).result()
    topk = res.topk_prompt_logprobs
    assert topk is not None and topk[0] is None and len(topk) == len(full)
    for pos, row in enumerate(topk[1:], start=1):
        assert row is not None and len(row) == 5
        values = [lp for _, lp in row]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert values[0] >= sampled_lp[pos] - 1e-5
