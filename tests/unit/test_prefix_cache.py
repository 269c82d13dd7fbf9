"""Per-session prefix KV reuse in the local sampler: a repeated prefix costs fewer prefilled
tokens, outputs are unchanged, sessions and adapters never share entries, the cache is bounded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lockstep.engine.types import LoraSpec, SampleParams, SampleRequest, SampleResult
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.rollout.local.prefix_cache import PrefixCache

GREEDY = SampleParams(max_tokens=8, temperature=0.0, stop_at_eos=False)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """The tiny model and two versions of one adapter (different non-zero B)."""
    model_dir = ensure_default_model(tmp_path_factory.mktemp("models"))
    lora = LoraModel(load_base_model(model_dir, DEFAULT_MODEL_NAME, "cpu")[0])
    spec = LoraSpec(rank=4, alpha=8.0, seed=1)
    lora.add_adapter("a", spec)
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for version in ("v1", "v2"):
        gen = torch.Generator().manual_seed(hash(version) % 1000)
        state = {
            k: (torch.randn(v.shape, generator=gen) * 0.5 if ".lora_B." in k else v)
            for k, v in lora.adapter_state("a").items()
        }
        save_peft_adapter(root / version, state, spec, DEFAULT_MODEL_NAME)
        out[version] = root / version
    return model_dir, out


@pytest.fixture(scope="module")
def engine(adapters: tuple[Path, dict[str, Path]]) -> Iterator[LocalSamplingEngine]:
    model_dir, dirs = adapters
    eng = LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME)
    eng.load_adapter("a", dirs["v1"])
    yield eng
    eng.close()


def run(
    engine: LocalSamplingEngine,
    tokens: list[int],
    namespace: str | None,
    adapter: str | None = "a",
    params: SampleParams = GREEDY,
    **kw: object,
) -> tuple[SampleResult, int, int]:
    """One request; returns its result and the prompt tokens it prefilled / reused."""
    before, reused_before = engine.prefill_counts()
    request = SampleRequest("r", adapter, tokens, 2, params, cache_namespace=namespace, **kw)  # type: ignore[arg-type]
    (result,) = engine.sample([request])
    assert result.error is None, result.error
    after, reused_after = engine.prefill_counts()
    return result, after - before, reused_after - reused_before


def same_output(a: SampleResult, b: SampleResult) -> None:
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert x.tokens == y.tokens
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)


def prompt_of(engine: LocalSamplingEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text))


def test_repeated_prompt_in_a_session_prefills_one_token(engine: LocalSamplingEngine) -> None:
    p = prompt_of(engine, "A long shared system prompt about parity bandits and rewards:")
    # Greedy: a cached prefix changes the GEMM shapes, so logits agree to rounding only.
    cold, cold_work, _ = run(engine, p, "session-1")
    warm, warm_work, reused = run(engine, p, "session-1")
    uncached, _, _ = run(engine, p, None)
    assert cold_work == len(p) and warm_work == 1 and reused == len(p) - 1
    same_output(cold, warm)
    same_output(uncached, warm)


def test_extended_prompt_prefills_only_the_new_turn(engine: LocalSamplingEngine) -> None:
    """Multi-turn: turn 2's prompt starts with turn 1's prompt."""
    first = prompt_of(engine, "User: name a colour.\nAssistant:")
    turn1, _, _ = run(engine, first, "chat")
    second = first + turn1.sequences[0].tokens + prompt_of(engine, "\nUser: another one?")
    warm, work, reused = run(engine, second, "chat")
    cold, cold_work, _ = run(engine, second, None)
    assert reused == len(first) and work == len(second) - len(first) and cold_work == len(second)
    same_output(cold, warm)


def test_no_sharing_across_sessions_adapters_or_weights(
    engine: LocalSamplingEngine, adapters: tuple[Path, dict[str, Path]]
) -> None:
    p = prompt_of(engine, "Shared prefix that two sessions both send")
    run(engine, p, "s1")
    assert run(engine, p, "s2")[1] == len(p), "a new namespace starts empty"
    assert run(engine, p, "s1", adapter=None)[1] == len(p), "other weights, other KV"
    engine.load_adapter("a", adapters[1]["v2"])  # new weights under the same adapter id
    try:
        fresh, work, _ = run(engine, p, "s1")
        assert work == len(p), "KV computed under replaced weights must not be reused"
        same_output(run(engine, p, None)[0], fresh)
    finally:
        engine.load_adapter("a", adapters[1]["v1"])


def test_prompt_logprob_requests_prefill_in_full(engine: LocalSamplingEngine) -> None:
    p = prompt_of(engine, "Score every token of this prompt")
    run(engine, p, "scores")
    result, work, _ = run(engine, p, "scores", prompt_logprobs=True)
    assert work == len(p) and result.prompt_logprobs is not None


def test_mixed_batch_of_hits_and_misses_equals_uncached(engine: LocalSamplingEngine) -> None:
    """Two hits of different cached lengths (prefilled together) beside a miss. Greedy: the
    warm and cold batches pad differently, so their logits agree to rounding only, and a
    temperature-1 draw that lands within rounding of a token boundary would flip (it did in a
    full-suite run, where allocation history changes the CPU kernels' rounding)."""
    prompts = [prompt_of(engine, t) for t in ("one fish", "two fish, red fish", "blue fish")]
    run(engine, prompts[0], "mix")
    run(engine, prompts[1][:-2], "mix")
    requests = [
        SampleRequest(f"r{i}", "a", p, 1, GREEDY, cache_namespace=ns)
        for i, (p, ns) in enumerate(zip(prompts, ("mix", "mix", "other"), strict=True))
    ]
    before = engine.prefill_counts()
    warm = engine.sample(requests)
    after = engine.prefill_counts()
    assert after[1] - before[1] == len(prompts[0]) - 1 + len(prompts[1]) - 2  # tokens reused
    cold = engine.sample([SampleRequest(r.request_id, "a", r.prompt, 1, GREEDY) for r in requests])
    for w, c in zip(warm, cold, strict=True):
        same_output(c, w)


def test_cache_is_bounded() -> None:
    kv = [(torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2))]
    cache = PrefixCache(max_sessions=2, max_tokens_per_session=25)
    for i in range(3):
        cache.store(f"s{i}", None, list(range(i * 100, i * 100 + 10)), kv)
    assert cache.lookup("s0", None, list(range(10))) is None  # least recently used session left
    assert cache.lookup("s2", None, list(range(200, 210))) is not None
    for start in (0, 100, 200):  # three 10-token prompts in one 25-token session: oldest leaves
        cache.store("s2", None, list(range(start, start + 10)), kv)
    assert cache.lookup("s2", None, list(range(200, 210))) is not None
    assert cache.lookup("s2", None, list(range(0, 10))) is None
    assert cache.cached_tokens() <= 2 * 25
    hit = cache.lookup("s2", None, list(range(100, 110)))
    assert hit is not None and hit.length == 9  # one token always left to feed
    entry_bytes = 2 * kv[0][0].nbytes
    assert cache.cached_bytes() == entry_bytes * 3  # s1 (1 entry) + s2 (2 entries)


def test_cache_is_bounded_in_bytes() -> None:
    kv = [(torch.zeros(1, 1, 10, 2), torch.zeros(1, 1, 10, 2))]
    entry_bytes = 2 * kv[0][0].nbytes
    cache = PrefixCache(max_sessions=100, max_tokens_per_session=1000, max_bytes=3 * entry_bytes)
    for i in range(5):
        cache.store(f"s{i}", None, list(range(10)), kv)
    assert cache.cached_bytes() <= 3 * entry_bytes
    assert cache.lookup("s0", None, list(range(10))) is None  # oldest sessions left first
    assert cache.lookup("s4", None, list(range(10))) is not None
    cache.forget_adapter("other")
    cache.store("s4", "other", list(range(10)), kv)
    cache.forget_adapter("other")
    assert cache.cached_bytes() <= 3 * entry_bytes
