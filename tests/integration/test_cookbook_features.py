"""Server features the cookbook relies on, through the real SDK: gspo, provenance spans on every
loss, record_stability_info, stable_reinforce's clear refusal, sampling clients on a base model
plus a checkpoint (KL references)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e

N = 10


@pytest.fixture(scope="module")
def trainer(service_client: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=7
    ).result()


def _tokens() -> list[int]:
    return [(7 * i + 3) % 900 + 20 for i in range(N + 1)]


def _datum(**inputs: object) -> types.Datum:
    tokens = _tokens()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )  # type: ignore[dict-item]


def _logprobs(trainer: tinker.TrainingClient) -> np.ndarray:
    out = trainer.forward([_datum()], "cross_entropy").result()
    return out.loss_fn_outputs[0]["logprobs"].to_numpy().astype(np.float64)


def test_gspo_uses_the_sequence_ratio_over_the_mask(trainer: tinker.TrainingClient) -> None:
    logp = _logprobs(trainer)
    adv = np.linspace(-1.0, 1.0, N)
    mask = np.array([0.0] * 4 + [1.0] * (N - 4))
    # The sampler's logprobs: 0.1 below the trainer's on the sampled (masked) tokens, garbage on
    # the prompt, which the mask keeps out of the ratio: s = exp(0.1), inside [0.8, 1.2].
    q = np.where(mask > 0, logp - 0.1, 0.0)
    out = trainer.forward(
        [_datum(logprobs=q.tolist(), advantages=adv.tolist(), sequence_ratio_mask=mask.tolist())],
        "gspo",
    ).result()
    s = math.exp(0.1)
    assert out.metrics["loss:sum"] == pytest.approx(-s * adv.sum(), abs=1e-4)
    # Far off-policy (s = e): every token is clipped at 1.2 where that is the smaller objective.
    far = np.where(mask > 0, logp - 1.0, 0.0)
    out = trainer.forward(
        [_datum(logprobs=far.tolist(), advantages=adv.tolist(), sequence_ratio_mask=mask.tolist())],
        "gspo",
    ).result()
    expected = -np.minimum(math.e * adv, 1.2 * adv).sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected, abs=1e-4)
    with pytest.raises(tinker.BadRequestError, match="sequence_ratio_mask"):
        trainer.forward([_datum(logprobs=q.tolist(), advantages=adv.tolist())], "gspo").result()


def _sampled_datum(trainer: tinker.TrainingClient) -> types.Datum:
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = _tokens()[:N]
    seq = (
        sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1))
        .result()
        .sequences[0]
    )
    assert seq.sequence_id and seq.logprobs is not None
    tokens = prompt + seq.tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * (N - 1) + [seq.logprobs[0]],
            "advantages": [0.0] * (N - 1) + [1.0],
        },  # type: ignore[dict-item]
    )
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=N)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=N - 1),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=1),
        ],
    )


def test_provenance_spans_are_accepted_on_every_loss(trainer: tinker.TrainingClient) -> None:
    datum = _sampled_datum(trainer)
    plain = types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs)
    mask = {"sequence_ratio_mask": [0.0] * (N - 1) + [1.0]}
    for loss, extra in [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", {}),
        ("cispo", {}),
        ("dro", {}),
        ("gspo", mask),
    ]:
        with_spans = types.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={**datum.loss_fn_inputs, **extra},
            model_input_spans=datum.model_input_spans,
            loss_fn_input_spans=datum.loss_fn_input_spans,
        )
        without = types.Datum(
            model_input=plain.model_input, loss_fn_inputs={**plain.loss_fn_inputs, **extra}
        )
        a = trainer.forward([with_spans], loss).result().metrics["loss:sum"]
        b = trainer.forward([without], loss).result().metrics["loss:sum"]
        assert a == pytest.approx(b), loss  # accepted and ignored


def test_stable_reinforce_is_refused_with_the_reason(trainer: tinker.TrainingClient) -> None:
    with pytest.raises(tinker.BadRequestError) as info:
        trainer.forward_backward([_sampled_datum(trainer)], "stable_reinforce").result()
    text = f"{info.value} {getattr(info.value, 'body', '')}"
    assert "stable_reinforce is not supported" in text and "importance_sampling" in text
    trainer.forward_backward([_datum(weights=[1.0] * N)], "cross_entropy").result()  # serving on


def test_kl_reference_sampler_on_base_model_and_checkpoint(
    service_client: tinker.ServiceClient, trainer: tinker.TrainingClient, base_model: str
) -> None:
    trainer.forward_backward([_datum(weights=[1.0] * N)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = trainer.save_weights_for_sampler("kl-ref").result().path
    prompt = types.ModelInput.from_ints(_tokens())
    base = service_client.create_sampling_client(base_model=base_model).result()
    both = service_client.create_sampling_client(base_model=base_model, model_path=path).result()
    tuned = trainer.create_sampling_client(path).result()
    lp_base = base.compute_logprobs(prompt).result()[1:]
    lp_both = both.compute_logprobs(prompt).result()[1:]
    lp_tuned = tuned.compute_logprobs(prompt).result()[1:]
    assert lp_both == pytest.approx(lp_tuned, abs=1e-5)  # model_path wins: the checkpoint
    assert max(abs(a - b) for a, b in zip(lp_base, lp_tuned, strict=True)) > 1e-3
