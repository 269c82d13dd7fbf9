"""Sampling in slices (`LocalSamplingEngine.sample_slice`): a long generation run a few decode
steps per call, with short samples started between its slices, equals the same generation run in
one call token for token and logprob for logprob (greedy and seeded, on the padded path and the
grouped one), and the short samples finish long before it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lockstep.engine.types import SampleParams, SampleRequest, SampleResult
from lockstep.modeling import zoo
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine

LONG = 30
GREEDY = SampleParams(max_tokens=LONG, temperature=0.0, stop_at_eos=False)
SEEDED = SampleParams(max_tokens=LONG, temperature=0.9, top_p=0.95, seed=7, stop_at_eos=False)


@pytest.fixture(scope="module", params=["padded", "grouped"])
def engine(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalSamplingEngine]:
    root = tmp_path_factory.mktemp("models")
    if request.param == "padded":
        eng = LocalSamplingEngine(ensure_default_model(root), DEFAULT_MODEL_NAME)
    else:  # sliding windows and sinks: equal-length groups over the model's own caches
        eng = LocalSamplingEngine(zoo.ensure_family("gpt_oss", root), zoo.served_name("gpt_oss"))
    assert eng._lora.arch.padded_sampling == (request.param == "padded")
    yield eng
    eng.close()


def long_and_short(params: SampleParams) -> tuple[SampleRequest, list[SampleRequest]]:
    long = SampleRequest("long", None, [5, 17, 42, 8, 99, 3], 2, params)
    shorts = [
        SampleRequest(
            f"short{i}",
            None,
            [7 + i, 11, 13 + i],
            1,
            SampleParams(max_tokens=4, temperature=0.7, seed=i, stop_at_eos=False),
        )
        for i in range(2)
    ]
    return long, shorts


def assert_same(got: SampleResult, want: SampleResult) -> None:
    assert got.error is None and want.error is None
    for a, b in zip(got.sequences, want.sequences, strict=True):
        assert a.tokens == b.tokens
        assert a.logprobs == b.logprobs  # the same computation, not merely close
        assert a.stop_reason == b.stop_reason


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_generation_in_slices_equals_one_call_and_short_ones_finish_first(
    engine: LocalSamplingEngine, params: SampleParams
) -> None:
    long, shorts = long_and_short(params)
    (whole,) = engine.sample([long])
    alone = {s.request_id: engine.sample([s])[0] for s in shorts}
    done: dict[str, SampleResult] = {}
    order: list[str] = []
    calls = [[long], *([s] for s in shorts)]
    for n in range(1000):  # 3 decode steps per call; a short sample starts at each of the next
        for result in engine.sample_slice(calls[n] if n < len(calls) else [], 3):
            done[result.request_id] = result
            order.append(result.request_id)
        if len(done) == 1 + len(shorts):
            break
    assert order[-1] == "long" and set(order[:-1]) == set(alone)  # the shorts did not wait
    assert_same(done["long"], whole)
    for rid, result in alone.items():
        assert_same(done[rid], result)
    assert n + 1 >= LONG // 3  # the long one really ran in slices


def _generated(engine: LocalSamplingEngine, request_id: str) -> int:
    """Tokens the running generation of `request_id` made so far (its longest row)."""
    for generation in engine._running:
        for i, result in enumerate(generation.results):
            if result.request_id == request_id:
                return max(len(row.tokens) for row in generation.samples[i])
    raise AssertionError(f"{request_id} is not running")


def test_a_short_sample_decodes_ahead_of_a_long_generation(engine: LocalSamplingEngine) -> None:
    """A 16-token sample beside a long generation takes its decode steps first, the long one a
    step per call meanwhile: it is answered after about its own steps, not after as many of
    the long one's; and both still equal their runs alone."""
    steps, short_tokens = 8, 16  # the lane's --sample-slice-steps default
    greedy = SampleParams(max_tokens=120, temperature=0.0, stop_at_eos=False)
    long = SampleRequest("long", None, [5, 17, 42], 1, greedy)
    params = SampleParams(max_tokens=short_tokens, temperature=0.8, seed=3, stop_at_eos=False)
    short = SampleRequest("short", None, [7, 11, 13], 1, params)
    (long_alone,) = engine.sample([long])
    (short_alone,) = engine.sample([short])
    assert engine.sample_slice([long], steps) == []
    before = _generated(engine, "long")
    calls, done = 0, None
    while done is None:
        calls += 1
        answered = engine.sample_slice([short] if calls == 1 else [], steps)
        done = next((r for r in answered if r.request_id == "short"), None)
        assert calls <= short_tokens // steps + 1, "the short sample waited on the long one"
    assert _generated(engine, "long") - before <= calls  # a step per call meanwhile
    assert_same(done, short_alone)
    rest: list[SampleResult] = []
    while not rest:
        rest = engine.sample_slice([], steps)
    assert_same(rest[0], long_alone)
