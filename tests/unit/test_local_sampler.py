"""LocalSamplingEngine: greedy / seeded sampling, logprob exactness, stops, batching, adapters."""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lockstep.engine.types import LoraSpec, SampleParams, SampleRequest, SampleResult
from lockstep.errors import UnsupportedModel, UserInputError
from lockstep.modeling import transformers_range
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import load_peft_adapter, save_peft_adapter
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.rollout.local.sampling import RowSampling, choose_tokens, sample_seed
from lockstep.rollout.local.stops import StopChecker

GREEDY = SampleParams(max_tokens=12, temperature=0.0, stop_at_eos=False)
ADAPTERS = ("tenant-a", "tenant-b")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two PEFT adapters with non-zero B (so they change the model), different ranks/targets."""
    base, _ = load_base_model(model_dir, DEFAULT_MODEL_NAME, "cpu")
    lora = LoraModel(base)
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "tenant-a": LoraSpec(rank=4, alpha=8.0, seed=1),
        "tenant-b": LoraSpec(rank=8, alpha=8.0, seed=2, train_mlp=False),
    }
    out: dict[str, Path] = {}
    for n, (adapter_id, spec) in enumerate(specs.items()):
        lora.add_adapter(adapter_id, spec)
        gen = torch.Generator().manual_seed(100 + n)
        state = {
            k: (torch.randn(v.shape, generator=gen) * 0.5 if ".lora_B." in k else v)
            for k, v in lora.adapter_state(adapter_id).items()
        }
        save_peft_adapter(root / adapter_id, state, spec, DEFAULT_MODEL_NAME)
        out[adapter_id] = root / adapter_id
    return out


@pytest.fixture(scope="module")
def engine(model_dir: Path, adapter_dirs: dict[str, Path]) -> Iterator[LocalSamplingEngine]:
    eng = LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME)
    for adapter_id, directory in adapter_dirs.items():
        eng.load_adapter(adapter_id, directory)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(model_dir: Path, adapter_dirs: dict[str, Path]) -> LoraModel:
    """An independent copy of the model: unpadded single-sequence forwards are the ground truth."""
    base, _ = load_base_model(model_dir, DEFAULT_MODEL_NAME, "cpu")
    lora = LoraModel(base)
    for adapter_id, directory in adapter_dirs.items():
        adapter = load_peft_adapter(directory)
        spec = lora.spec_of(adapter.state, adapter.rank, adapter.alpha)
        lora.load_adapter_state(adapter_id, adapter.state, spec)
    return lora


def full_logprobs(ref: LoraModel, tokens: Sequence[int], adapter: str | None) -> torch.Tensor:
    """log_softmax of one unpadded forward: row i = distribution of token i + 1. [T, V]"""
    with torch.inference_mode(), ref.row_adapters([adapter]):
        logits = ref.base(input_ids=torch.tensor([list(tokens)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt(engine: LocalSamplingEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


def req(
    tokens: list[int],
    params: SampleParams = GREEDY,
    num_samples: int = 1,
    adapter: str | None = None,
    rid: str = "r",
    **kw: object,
) -> SampleRequest:
    return SampleRequest(rid, adapter, tokens, num_samples, params, **kw)  # type: ignore[arg-type]


def one(engine: LocalSamplingEngine, request: SampleRequest) -> SampleResult:
    (result,) = engine.sample([request])
    assert result.error is None, result.error
    return result


# -- exactness ------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [None, "tenant-a"])
def test_greedy_is_deterministic_and_matches_full_forward(
    engine: LocalSamplingEngine, reference: LoraModel, adapter: str | None
) -> None:
    p = prompt(engine, "English: banana split\nPig Latin:")
    first = one(engine, req(p, num_samples=3, adapter=adapter))
    again = one(engine, req(p, num_samples=1, adapter=adapter))
    seqs = first.sequences + again.sequences
    assert all(s.tokens == seqs[0].tokens for s in seqs)
    seq = seqs[0]
    assert len(seq.tokens) == GREEDY.max_tokens and seq.stop_reason == "length"
    lp = full_logprobs(reference, p + seq.tokens, adapter)[len(p) - 1 : -1]
    assert lp.argmax(-1).tolist() == seq.tokens
    expected = lp.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)


def test_the_kv_cache_goes_by_the_name_this_transformers_takes(
    engine: LocalSamplingEngine, reference: LoraModel
) -> None:
    """transformers renamed a forward's `past_key_values` to `cache` (5.2x, model by model; the
    old name warns and goes in 5.40): the decoders pass the cache by the name the model takes,
    so a decode neither warns nor, later, loses its past (the test above: decode == full forward,
    run under the lowest release too). A forward that takes neither is refused by name."""
    name = transformers_range.cache_argument(reference.base)
    assert name in inspect.signature(reference.base.forward).parameters
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        one(engine, req(prompt(engine, "English: banana split\nPig Latin:"), num_samples=2))
    assert not [str(w.message) for w in caught if "past_key_values" in str(w.message)]

    class NoCache(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return input_ids

    with pytest.raises(UnsupportedModel, match="NoCache.forward takes its KV cache by none"):
        transformers_range.cache_argument(NoCache())


def _sampling_distribution(lp: torch.Tensor, params: SampleParams) -> torch.Tensor:
    """log p of what a row draws from: log_softmax(lp / T), then top-k / top-p, renormalised."""
    scaled = torch.log_softmax(lp.double() / params.temperature, dim=-1)
    order = scaled.argsort(dim=-1, descending=True, stable=True)
    sorted_lp = scaled.gather(-1, order)
    keep = torch.ones_like(sorted_lp, dtype=torch.bool)
    if params.top_k > 0:
        keep[:, params.top_k :] = False
    probs = torch.softmax(sorted_lp.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= (probs.cumsum(-1) - probs) < params.top_p
    keep[:, 0] = True
    mask = torch.zeros_like(keep).scatter_(-1, order, keep)
    return torch.log_softmax(scaled.masked_fill(~mask, float("-inf")), dim=-1)


def test_sampled_logprobs_are_the_sampling_distribution(
    engine: LocalSamplingEngine, reference: LoraModel
) -> None:
    """A sampled token's logprob is under the distribution it was drawn from: temperature, then
    top-k / top-p truncation, renormalised (hosted Tinker's log p_T)."""
    p = prompt(engine, "The quick brown fox")
    params = SampleParams(max_tokens=10, temperature=0.7, top_k=50, top_p=0.9, seed=7)
    for seq in one(engine, req(p, params, num_samples=2, adapter="tenant-b")).sequences:
        lp = full_logprobs(reference, p + seq.tokens, "tenant-b")[len(p) - 1 : -1]
        dist = _sampling_distribution(lp, params)
        expected = dist.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0].float()
        assert torch.allclose(torch.tensor(seq.logprobs), expected, atol=1e-4, rtol=0)
        raw = lp.gather(-1, torch.tensor(seq.tokens)[:, None])[:, 0]
        assert (torch.tensor(seq.logprobs) - raw).abs().max() > 1e-2  # not log p_1
        assert bool(torch.isfinite(expected).all())  # every drawn token was kept


@pytest.mark.parametrize("temperature", [0.5, 0.7, 1.2, 1.8])
def test_temperature_logprobs_scale_pairwise(
    engine: LocalSamplingEngine, temperature: float
) -> None:
    """tinker-cookbook's temperature check: for tokens i, j of one position,
    log p_T(i) - log p_T(j) = (1/T) (log p_1(i) - log p_1(j)); and the sampled tokens' logprobs
    appear in their position's top-k at temperature T."""
    p = prompt(engine, "English: banana split\nPig Latin:")
    k = 20

    def first(t: float) -> tuple[list[int], list[float], list[int], list[float]]:
        params = SampleParams(max_tokens=1, temperature=t, seed=3, stop_at_eos=False)
        seq = one(engine, req(p, params, topk_sample_logprobs=k)).sequences[0]
        assert seq.topk_ids is not None and seq.topk_logprobs is not None
        return seq.topk_ids[0], seq.topk_logprobs[0], seq.tokens, seq.logprobs

    ids_1, lps_1, _, _ = first(1.0)
    ids_t, lps_t, tokens, logprobs = first(temperature)
    assert ids_t == ids_1  # scaling keeps the order
    one_ = torch.tensor(lps_1, dtype=torch.float64)
    at_t = torch.tensor(lps_t, dtype=torch.float64)
    expected = (one_[:, None] - one_[None, :]) / temperature
    assert torch.allclose(at_t[:, None] - at_t[None, :], expected, atol=1e-4, rtol=1e-4)
    if tokens[0] in ids_t:
        assert logprobs[0] == pytest.approx(lps_t[ids_t.index(tokens[0])], abs=1e-5)


def test_prompt_logprobs_match_full_forward(
    engine: LocalSamplingEngine, reference: LoraModel
) -> None:
    """compute_logprobs = sample(max_tokens=1, prompt_logprobs=True)."""
    p = prompt(engine, "English: pickle jar\nPig Latin: ickle-pay")
    params = SampleParams(max_tokens=1, temperature=1.0)
    result = one(engine, req(p, params, adapter="tenant-a", prompt_logprobs=True))
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(p)
    assert math.isnan(result.prompt_logprobs[0])
    lp = full_logprobs(reference, p, "tenant-a")[:-1]
    expected = lp.gather(-1, torch.tensor(p[1:])[:, None])[:, 0]
    assert torch.allclose(torch.tensor(result.prompt_logprobs[1:]), expected, atol=1e-4, rtol=0)
    assert result.topk_prompt is None

    last = one(
        engine, req(p, params, adapter="tenant-a", prompt_logprobs=True, prompt_logprobs_last_n=3)
    ).prompt_logprobs
    assert last is not None and len(last) == len(p)
    assert all(math.isnan(x) for x in last[:-3])
    assert last[-3:] == pytest.approx(result.prompt_logprobs[-3:], abs=1e-5)


def test_topk_prompt_and_sample_logprobs(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "Space exploration is fun")
    result = one(
        engine,
        req(
            p,
            SampleParams(max_tokens=4, temperature=1.0, seed=3),
            prompt_logprobs=True,
            topk_prompt_logprobs=5,
            topk_sample_logprobs=3,
            prompt_logprobs_last_n=len(p) - 2,
        ),
    )
    top, plp = result.topk_prompt, result.prompt_logprobs
    assert top is not None and plp is not None and len(top) == len(p)
    assert top[0] is None and top[1] is None  # position 0 and before last_n
    for pos in range(2, len(p)):
        row = top[pos]
        assert row is not None and len(row) == 5
        values = [v for _, v in row]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert values[0] >= plp[pos] - 1e-6
        assert len({t for t, _ in row}) == 5
    seq = result.sequences[0]
    assert seq.topk_ids is not None and seq.topk_logprobs is not None
    assert len(seq.topk_ids) == len(seq.tokens) == 4
    for ids, lps, lp in zip(seq.topk_ids, seq.topk_logprobs, seq.logprobs, strict=True):
        assert len(ids) == len(lps) == 3 and lps == sorted(lps, reverse=True)
        assert lps[0] >= lp - 1e-6 and all(v <= 0 for v in lps)


# -- sampling -------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "coding wizard")
    params = SampleParams(max_tokens=8, temperature=1.0, seed=1234)
    a = one(engine, req(p, params, num_samples=3)).sequences
    b = one(engine, req(p, params, num_samples=3)).sequences
    assert [s.tokens for s in a] == [s.tokens for s in b]
    assert len({tuple(s.tokens) for s in a}) == 3  # samples of one request differ
    other = one(engine, req(p, replace(params, seed=1235))).sequences[0]
    assert other.tokens != a[0].tokens
    unseeded = [one(engine, req(p, replace(params, seed=None))).sequences[0] for _ in range(2)]
    assert unseeded[0].tokens != unseeded[1].tokens
    assert sample_seed(5, 1) != sample_seed(6, 0) and sample_seed(-1, 0) >= 0


def test_top_k_one_and_tiny_top_p_are_greedy(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "rubber duck")
    greedy = one(engine, req(p)).sequences[0].tokens
    for params in (
        replace(GREEDY, temperature=1.0, top_k=1, seed=1),
        replace(GREEDY, temperature=2.0, top_p=1e-6, seed=2),
    ):
        assert one(engine, req(p, params)).sequences[0].tokens == greedy


def test_choose_tokens_respects_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 2))
    draws: dict[str, set[int]] = {"k": set(), "p": set()}
    for seed in range(200):
        rows = [
            RowSampling(1.0, 2, 1.0, torch.Generator().manual_seed(seed)),
            RowSampling(1.0, -1, 0.85, torch.Generator().manual_seed(seed)),
        ]
        choice = choose_tokens(logits, rows)
        k_tok, p_tok = choice.tokens.tolist()
        assert bool(torch.isinf(choice.logprobs[0, 2:]).all())  # truncated: probability 0
        kept = choice.logprobs[0, :2].exp()
        assert torch.allclose(kept, torch.tensor([0.5, 0.3]) / 0.8, atol=1e-6)
        draws["k"].add(k_tok)
        draws["p"].add(p_tok)
    assert draws == {"k": {0, 1}, "p": {0, 1, 2}}


# -- stops ----------------------------------------------------------------------------------


def test_stop_token_is_kept_and_reported(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "donut shop")
    greedy = one(engine, req(p)).sequences[0].tokens
    stop_at = next(i for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    seq = one(engine, req(p, replace(GREEDY, stop_tokens=(greedy[stop_at],)))).sequences[0]
    assert seq.tokens == greedy[: stop_at + 1] and seq.stop_reason == "stop"
    assert len(seq.logprobs) == len(seq.tokens)
    # stop_at_eos=False and no stops: always max_tokens, "length"
    assert len(greedy) == GREEDY.max_tokens


def test_stop_string_truncates_after_the_completing_token(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "quantum physics")
    greedy = one(engine, req(p)).sequences[0].tokens
    decode = engine.decode
    # The last two characters of the text after token j, where they first appear.
    j, stop = next(
        (j, decode(greedy[: j + 1])[-2:])
        for j in range(2, len(greedy))
        if decode(greedy[: j + 1])[-2:] not in decode(greedy[:j])
        and "\ufffd" not in decode(greedy[: j + 1])[-2:]
    )
    seq = one(engine, req(p, replace(GREEDY, stop_strings=("never-there", stop)))).sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens == greedy[: j + 1]
    assert stop in decode(seq.tokens) and stop not in decode(seq.tokens[:-1])


def test_stop_checker_eos_and_strings() -> None:
    text = {1: "a", 2: "\n", 3: "b", 9: "<eos>"}

    def decode(ids: Sequence[int]) -> str:
        return "".join(text[i] for i in ids)

    params = SampleParams(max_tokens=5, stop_strings=("\nb",))
    checker = StopChecker(params, eos_ids={9}, decode=decode)
    assert checker.check([1]) is None and checker.check([1, 2]) is None
    assert checker.check([1, 2, 3]) == "stop"
    assert checker.check([1, 9]) == "stop"
    assert checker.check([1, 1, 1, 1, 1]) == "length"
    no_eos = StopChecker(replace(params, stop_at_eos=False), eos_ids={9}, decode=decode)
    assert no_eos.check([1, 9]) is None


# -- batching and adapters ------------------------------------------------------------------


def test_batch_invariance_across_lengths_and_adapters(engine: LocalSamplingEngine) -> None:
    texts = ["Hi", "English: banana split\nPig Latin:", "a somewhat longer prompt about ducks"]
    seeded = SampleParams(max_tokens=9, temperature=0.9, seed=11, stop_at_eos=False)
    requests = [
        req(prompt(engine, texts[0]), GREEDY, 2, "tenant-a", "0", prompt_logprobs=True),
        req(prompt(engine, texts[1]), GREEDY, 1, None, "1", prompt_logprobs=True),
        req(prompt(engine, texts[2]), seeded, 2, "tenant-b", "2", prompt_logprobs=True),
        req(prompt(engine, texts[1]), replace(GREEDY, max_tokens=3), 1, "tenant-b", "3"),
    ]
    batched = engine.sample(requests)
    for r, together in zip(requests, batched, strict=True):
        alone = one(engine, r)
        assert together.error is None and together.request_id == r.request_id
        for s_alone, s_batch in zip(alone.sequences, together.sequences, strict=True):
            assert s_alone.tokens == s_batch.tokens
            assert s_alone.stop_reason == s_batch.stop_reason
            assert s_alone.logprobs == pytest.approx(s_batch.logprobs, abs=1e-5, rel=0)
        if r.prompt_logprobs:
            assert alone.prompt_logprobs is not None and together.prompt_logprobs is not None
            assert alone.prompt_logprobs[1:] == pytest.approx(
                together.prompt_logprobs[1:], abs=1e-5, rel=0
            )


def test_adapters_change_outputs(engine: LocalSamplingEngine) -> None:
    p = prompt(engine, "English: banana split\nPig Latin:")
    outs = {a: one(engine, req(p, adapter=a)).sequences[0] for a in (None, *ADAPTERS)}
    assert len({tuple(s.tokens) for s in outs.values()}) == 3
    assert outs[None].logprobs[0] != pytest.approx(outs["tenant-a"].logprobs[0], abs=1e-3)


def test_lru_eviction_reloads_transparently(
    engine: LocalSamplingEngine, model_dir: Path, adapter_dirs: dict[str, Path]
) -> None:
    small = LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME, max_adapters=1)
    for adapter_id, directory in adapter_dirs.items():
        small.load_adapter(adapter_id, directory)
        small.load_adapter(adapter_id, directory)  # idempotent
    p = prompt(engine, "pickle jar")
    expected = {a: one(engine, req(p, adapter=a)).sequences[0].tokens for a in ADAPTERS}
    for adapter in (*ADAPTERS, *ADAPTERS, ADAPTERS[0]):
        assert one(small, req(p, adapter=adapter)).sequences[0].tokens == expected[adapter]
        assert small.resident_adapters() == [adapter]
    mixed = small.sample([req(p, adapter=a, rid=str(a)) for a in (*ADAPTERS, None, *ADAPTERS)])
    assert [r.error for r in mixed] == [None] * 5
    assert [r.sequences[0].tokens for r in mixed] == [
        expected["tenant-a"],
        expected["tenant-b"],
        one(engine, req(p)).sequences[0].tokens,
        expected["tenant-a"],
        expected["tenant-b"],
    ]
    small.unload_adapter("tenant-a")
    (gone,) = small.sample([req(p, adapter="tenant-a")])
    assert gone.error is not None and "adapter_id" in gone.error
    with pytest.raises(UserInputError):
        small.load_adapter("broken", model_dir)  # a model dir is not an adapter dir
    small.close()


def test_per_request_errors_do_not_fail_the_batch(engine: LocalSamplingEngine) -> None:
    """The engine's own refusal (an adapter it does not hold) fails that request alone; what a
    request carries was judged at admission (tests/unit/test_request_rules.py)."""
    good = prompt(engine, "coding wizard")
    requests = [
        req(good, adapter="nobody", rid="adapter"),
        req(good, rid="ok", prompt_logprobs=True),
    ]
    results = engine.sample(requests)
    errors = {r.request_id: r.error for r in results}
    assert errors["adapter"] is not None and "adapter_id" in errors["adapter"]
    ok = results[-1]
    assert ok.error is None and ok.sequences[0].tokens == one(engine, req(good)).sequences[0].tokens


def test_sampler_holds_no_grads(engine: LocalSamplingEngine) -> None:
    one(engine, req(prompt(engine, "hello"), adapter="tenant-a"))
    lora = engine._lora
    params = list(lora.base.parameters()) + [
        p for a in lora.adapter_ids() for p in lora.adapter_parameters(a)
    ]
    assert params and not any(p.requires_grad or p.grad is not None for p in params)
