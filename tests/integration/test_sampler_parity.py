"""Every sampling engine that runs here serves what the local sampler serves.

The same cases go through the tinker SDK to `lockstep serve --sampler local` and `--sampler vllm`
(the session's `vllm_server`, its venv built on first use); each engine's
answers are compared with the local sampler's: n > 1 greedy and seeded, stop tokens and strings,
prompt and top-k logprobs, max_tokens edges, and tinker-cookbook's temperature check (sampled
logprobs at temperature T are log p_T: pairwise differences scale by 1/T). SGLang does not run
here; its engine is tested against a stand-in (tests/rollout).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.devserver import Server
from tests.integration.conftest import API_KEY

pytestmark = pytest.mark.e2e
PROMPT_TEXT = "English: banana split\nPig Latin:"


@pytest.fixture(scope="module", params=["local", "vllm"])
def engine(request: pytest.FixtureRequest, server: Server) -> tinker.SamplingClient:
    srv = server if request.param == "local" else request.getfixturevalue("vllm_server")
    return _sampler(srv)


@pytest.fixture(scope="module")
def local(server: Server) -> tinker.SamplingClient:
    return _sampler(server)


def _sampler(srv: Server) -> tinker.SamplingClient:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    service = tinker.ServiceClient(base_url=srv.base_url, api_key=API_KEY)
    return service.create_sampling_client(base_model=DEFAULT_MODEL_NAME).result()


@pytest.fixture(scope="module")
def tokenizer(server: Server) -> Any:
    from transformers import AutoTokenizer

    from lockstep.modeling.tiny import ensure_default_model

    return AutoTokenizer.from_pretrained(ensure_default_model(server.data_dir / "models"))


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(PROMPT_TEXT))


def _sample(
    client: tinker.SamplingClient, tokens: list[int], n: int = 1, **kw: object
) -> types.SampleResponse:
    extra = {k: kw.pop(k) for k in list(kw) if k.startswith(("include_", "topk_"))}
    params = types.SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **kw})  # type: ignore[arg-type]
    return client.sample(
        prompt=types.ModelInput.from_ints(tokens), num_samples=n, sampling_params=params, **extra
    ).result()


def test_greedy_n_samples(
    engine: tinker.SamplingClient, local: tinker.SamplingClient, prompt: list[int]
) -> None:
    out = _sample(engine, prompt, n=4)  # vLLM alone refuses n > 1 at temperature 0
    ref = _sample(local, prompt, n=1).sequences[0]
    assert len(out.sequences) == 4
    for seq in out.sequences:
        assert seq.tokens == ref.tokens and seq.stop_reason == ref.stop_reason
        np.testing.assert_allclose(seq.logprobs, ref.logprobs, atol=1e-4)


def test_seeded_n_samples(
    engine: tinker.SamplingClient, local: tinker.SamplingClient, prompt: list[int]
) -> None:
    a = _sample(engine, prompt, n=3, temperature=1.0, seed=11, stop=[])
    b = _sample(engine, prompt, n=3, temperature=1.0, seed=11, stop=[])
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) == 3, "the samples of one request differ"
    for seq in a.sequences:  # at T = 1 without truncation, logprobs are the model's own
        assert len(seq.tokens) == 8
        full = local.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
        np.testing.assert_allclose(seq.logprobs, full[len(prompt) :], atol=1e-4)


def test_stops(
    engine: tinker.SamplingClient, local: tinker.SamplingClient, prompt: list[int], tokenizer: Any
) -> None:
    greedy = _sample(local, prompt, stop=[]).sequences[0].tokens
    at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    by_token = _sample(engine, prompt, stop=[greedy[at]]).sequences[0]
    assert by_token.tokens == greedy[: at + 1] and by_token.stop_reason == "stop"
    text = tokenizer.decode(greedy[at : at + 2])
    ref = _sample(local, prompt, stop=[text]).sequences[0]
    by_string = _sample(engine, prompt, stop=[text]).sequences[0]
    assert by_string.tokens == ref.tokens and by_string.stop_reason == ref.stop_reason == "stop"
    never = _sample(engine, prompt, stop=[], max_tokens=3).sequences[0]
    assert never.tokens == greedy[:3] and never.stop_reason == "length"


def test_prompt_and_topk_logprobs(
    engine: tinker.SamplingClient, local: tinker.SamplingClient, prompt: list[int]
) -> None:
    kw = dict(
        max_tokens=1, include_prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=4
    )
    out, ref = _sample(engine, prompt, **kw), _sample(local, prompt, **kw)
    assert out.prompt_logprobs is not None and ref.prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
    np.testing.assert_allclose(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], atol=1e-4)
    assert out.topk_prompt_logprobs is not None and ref.topk_prompt_logprobs is not None
    for row, ref_row in zip(
        out.topk_prompt_logprobs[1:], ref.topk_prompt_logprobs[1:], strict=True
    ):
        assert row is not None and ref_row is not None
        assert [t for t, _ in row] == [t for t, _ in ref_row]
        np.testing.assert_allclose([v for _, v in row], [v for _, v in ref_row], atol=1e-4)
    seq, ref_seq = out.sequences[0], ref.sequences[0]
    assert seq.topk_logprobs is not None and ref_seq.topk_logprobs is not None
    assert [[t for t, _ in r] for r in seq.topk_logprobs] == [
        [t for t, _ in r] for r in ref_seq.topk_logprobs
    ]


def test_max_tokens_edges(engine: tinker.SamplingClient, prompt: list[int]) -> None:
    one = _sample(engine, prompt, n=2, max_tokens=1, temperature=1.0, seed=3)
    assert [len(s.tokens) for s in one.sequences] == [1, 1]
    assert all(s.stop_reason == "length" for s in one.sequences)
    ctx = 4096  # the tiny model's context: prompt + max_tokens beyond it is refused, not cut
    with pytest.raises(tinker.BadRequestError):
        _sample(engine, prompt, max_tokens=ctx - len(prompt) + 1)


@pytest.mark.parametrize("temperature", [0.5, 1.5])
def test_temperature_logprobs(
    engine: tinker.SamplingClient, prompt: list[int], temperature: float
) -> None:
    """tinker-cookbook's validate_temperature_logprobs: for tokens i, j of one position,
    log p_T(i) - log p_T(j) = (1/T) (log p_1(i) - log p_1(j)), and a token sampled at T
    reports its log p_T."""
    k = 20

    def first(t: float) -> types.SampledSequence:
        return _sample(
            engine, prompt, max_tokens=1, temperature=t, seed=5, topk_sample_logprobs=k
        ).sequences[0]

    at_1, at_t = first(1.0), first(temperature)
    assert at_1.topk_logprobs is not None and at_t.topk_logprobs is not None
    ids_1, lps_1 = zip(*at_1.topk_logprobs[0], strict=True)
    ids_t, lps_t = zip(*at_t.topk_logprobs[0], strict=True)
    assert ids_t == ids_1
    one_, t_ = np.asarray(lps_1, np.float64), np.asarray(lps_t, np.float64)
    expected = (one_[:, None] - one_[None, :]) / temperature
    np.testing.assert_allclose(t_[:, None] - t_[None, :], expected, atol=2e-4, rtol=1e-4)
    token = at_t.tokens[0]
    if token in ids_t:
        assert at_t.logprobs[0] == pytest.approx(lps_t[ids_t.index(token)], abs=1e-4)
