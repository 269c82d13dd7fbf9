"""Loss functions, datum features and sampling options, one probe each."""

import inspect
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from compat.context import ClientSide, Ctx, expect

# ------------------------------------------------------------------------------ features


def _fb(c: Ctx, loss: str, data: list[Any], config: dict[str, Any] | None = None) -> Any:
    return c.shared_trainer.forward_backward(data, loss, config).result()


def _spans(c: Ctx, n: int = 8) -> tuple[Any, Any, Any]:
    """An RL datum with provenance spans naming a sampled sequence, and the sampler behind it."""
    from tinker import types

    sampler = c.shared_trainer.save_weights_and_get_sampling_client(
        record_stability_info=True
    ).result()
    prompt = list(range(1, n))
    seq = (
        sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1))
        .result()
        .sequences[0]
    )
    tokens = prompt + seq.tokens
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs=cast(
            Any,
            {
                "target_tokens": tokens[1:],
                "logprobs": [0.0] * (n - 2) + [float(seq.logprobs[0])],
                "advantages": [0.0] * (n - 2) + [1.0],
            },
        ),
    ).with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=n - 1)
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n - 2),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=1),
        ],
    )
    return datum, seq, sampler


FEATURES: dict[str, dict[str, Callable[[Ctx], str | None]]] = {
    "loss": {},
    "sampling": {},
    "datum": {},
    "endpoints": {},
}


def feature(
    table: str, name: str
) -> Callable[[Callable[[Ctx], str | None]], Callable[[Ctx], str | None]]:
    def register(fn: Callable[[Ctx], str | None]) -> Callable[[Ctx], str | None]:
        FEATURES[table][name] = fn
        return fn

    return register


@feature("loss", "cross_entropy")
def _(c: Ctx) -> str | None:
    out = _fb(c, "cross_entropy", [c.datum(weights=[0.5] * 8)])
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    expect(abs(out.metrics["loss:sum"] + 0.5 * lp.sum()) < 1e-3 * abs(lp.sum()), "loss:sum")
    return "`loss:sum` = -sum(logp * weights)"


@feature("loss", "cross_entropy, 2-D targets (top-K soft targets)")
def _(c: Ctx) -> str | None:
    from tinker import types

    targets = np.stack([np.arange(1, 9), np.arange(2, 10), np.arange(3, 11)], axis=1)
    weights = np.full((8, 3), 1 / 3, np.float32)
    out = _fb(
        c,
        "cross_entropy",
        [
            c.datum(
                target_tokens=types.TensorData.from_numpy(targets),
                weights=types.TensorData.from_numpy(weights),
            )
        ],
    )
    expect(out.loss_fn_outputs[0]["logprobs"].to_numpy().shape == (8, 3), "shape")
    return "`target_tokens` and `weights` [N, K]; logprobs [N, K]"


@feature("loss", "cross_entropy, negative weights (forward_backward_custom)")
def _(c: Ctx) -> str | None:
    _fb(c, "cross_entropy", [c.datum(weights=[-1.0, 2.0, -0.5, 0.0, 1.0, 1.0, -3.0, 0.25])])
    return "any finite real weight"


@feature("loss", "importance_sampling")
def _(c: Ctx) -> str | None:
    _fb(c, "importance_sampling", [c.rl_datum()])
    return None


@feature("loss", "ppo")
def _(c: Ctx) -> str | None:
    _fb(c, "ppo", [c.rl_datum()], {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    return "`clip_low_threshold` / `clip_high_threshold` (config or per-token inputs)"


@feature("loss", "cispo")
def _(c: Ctx) -> str | None:
    _fb(c, "cispo", [c.rl_datum()])
    return "as ppo"


@feature("loss", "dro")
def _(c: Ctx) -> str | None:
    _fb(c, "dro", [c.rl_datum()], {"beta": 0.05})
    return "`beta` (default 0.05)"


@feature("loss", "gspo")
def _(c: Ctx) -> str | None:
    _fb(c, "gspo", [c.rl_datum(sequence_ratio_mask=[0.0] * 4 + [1.0] * 4)])
    return (
        "GSPO-token: the sequence ratio over the tokens `sequence_ratio_mask` marks "
        "(required, at least one token), clipped like ppo"
    )


@feature("loss", "stable_reinforce")
def _(c: Ctx) -> str | None:
    datum, _, _ = _spans(c)
    _fb(c, "stable_reinforce", [datum])
    return None


def _squared(logprobs: Any, weights: Any) -> Any:
    loss = (logprobs * logprobs * weights).sum()
    return loss, {"custom/squared:sum": loss}


@feature("loss", "custom (server-side loss_id)")
def _(c: Ctx) -> str | None:
    handle = c.service.create_custom_loss(_squared, {"logprobs": 1, "weights": 1}).result()
    expect(handle.loss_id is not None, "the loss was not uploaded")
    out = _fb(c, "custom", [c.datum(weights=[1.0] * 8)], {"loss_id": handle.loss_id})
    expect("custom/squared:sum" in out.metrics, str(out.metrics))
    return (
        "create_custom_loss uploads the traced graph, rebuilt from an allowlist of tensor "
        "ops; it runs per datum inside the fused pass (one clock cycle)"
    )


@feature("datum", "provenance spans on every loss")
def _(c: Ctx) -> str | None:
    datum, _, _ = _spans(c)
    for loss in ("cross_entropy", "importance_sampling", "ppo", "cispo"):
        _fb(c, loss, [datum])
    plain = c.datum()
    spans = [__import__("tinker").types.PromptProvenanceSpan(sequence_id="x", offset=0, length=8)]
    c.shared_trainer.forward(
        [plain.with_provenance(model_input=spans, loss_fn_inputs=spans)], "cross_entropy"
    ).result()
    return "accepted and ignored (they only feed stable_reinforce)"


@feature("datum", "list / numpy / torch loss inputs")
def _(c: Ctx) -> str | None:
    import torch

    _fb(c, "cross_entropy", [c.datum(weights=np.ones(8, np.float32))])
    _fb(c, "cross_entropy", [c.datum(weights=torch.ones(8))])
    return None


@feature("datum", "chunked calls (> 1024 datums)")
def _(c: Ctx) -> str | None:
    out = _fb(c, "cross_entropy", [c.datum(2) for _ in range(1025)])
    expect(len(out.loss_fn_outputs) == 1025, "outputs")
    return "all chunks of one call land in one clock cycle"


@feature("datum", "image chunks")
def _(c: Ctx) -> str | None:
    from tinker import types

    image = types.ModelInput(
        chunks=[types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)]
    )
    targets: Any = {"target_tokens": [1, 2, 3, 4]}
    c.shared_trainer.forward(
        [types.Datum(model_input=image, loss_fn_inputs=targets)], "cross_entropy"
    ).result()
    return None


@feature("sampling", "stop strings / stop token ids")
def _(c: Ctx) -> str | None:
    from tinker import types

    for stop in (["\n"], [2, 3]):
        c.sampler.sample(c.prompt(), 1, types.SamplingParams(max_tokens=4, stop=stop)).result()
    return None


@feature("sampling", "temperature, top_p, top_k, seed")
def _(c: Ctx) -> str | None:
    from tinker import types

    params = types.SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, top_k=50, seed=3)
    a = c.sampler.sample(c.prompt(), 1, params).result().sequences[0].tokens
    b = c.sampler.sample(c.prompt(), 1, params).result().sequences[0].tokens
    expect(a == b, "seeded sampling repeats")
    return "a seed makes sampling repeatable"


@feature("sampling", "include_prompt_logprobs, topk_prompt_logprobs")
def _(c: Ctx) -> str | None:
    from tinker import types

    out = c.sampler.sample(
        c.prompt(),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=5,
    ).result()
    expect(out.topk_prompt_logprobs is not None and len(out.topk_prompt_logprobs[1]) == 5, "k")
    return None


@feature("sampling", "prompt_logprobs_last_n")
def _(c: Ctx) -> str | None:
    lps = c.sampler.compute_logprobs(c.prompt(), prompt_logprobs_last_n=2).result()
    expect(lps[:4] == [None] * 4 and None not in lps[4:], str(lps))
    return None


@feature("sampling", "sampled logprobs at temperature T")
def _(c: Ctx) -> str | None:
    from tinker import types

    def top(t: float) -> list[tuple[int, float]]:
        params = types.SamplingParams(max_tokens=1, temperature=t, seed=1)
        out = c.sampler.sample(c.prompt(), 1, params, topk_sample_logprobs=5).result()
        return list(out.sequences[0].topk_logprobs[0])

    one, half = top(1.0), top(0.5)
    expect([t for t, _ in one] == [t for t, _ in half], "order")
    gap_1, gap_half = one[0][1] - one[-1][1], half[0][1] - half[-1][1]
    expect(abs(gap_half - 2 * gap_1) < 1e-3, "pairwise differences scale by 1/T")
    return "log p_T, as hosted Tinker: after temperature (and top-k / top-p, see below)"


@feature("sampling", "topk_sample_logprobs")
def _(c: Ctx) -> str | None:
    from tinker import types

    c.sampler.sample(
        c.prompt(), 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=3
    ).result()
    return None


@feature("sampling", "record_stability_info, sequence_id")
def _(c: Ctx) -> str | None:
    _, seq, _ = _spans(c)
    expect(bool(seq.sequence_id), "sequence_id")
    return "accepted; sequence ids are unique per sample, nothing is recorded"


@feature("sampling", "target_prompt_logprobs")
def _(c: Ctx) -> str | None:
    import tinker
    from tinker import types

    target = types.TensorData.from_numpy(np.ones((6, 1), np.int64))
    sample = tinker.SamplingClient.sample
    if "target_prompt_logprobs" not in inspect.signature(sample).parameters:
        raise ClientSide("not in this SDK")
    c.sampler.sample(
        c.prompt(), 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=target
    ).result()
    return None


@feature("sampling", "prompt_alt_tokens")
def _(c: Ctx) -> str | None:
    import tinker
    from tinker import types

    if "prompt_alt_tokens_k" not in inspect.signature(tinker.SamplingClient.sample).parameters:
        raise ClientSide("not in this SDK")
    c.sampler.sample(
        c.prompt(), 1, types.SamplingParams(max_tokens=1), prompt_alt_tokens_k=2
    ).result()
    return None
