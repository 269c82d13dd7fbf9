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
