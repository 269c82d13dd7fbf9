"""Static decode (`--sampler-decode static`, rollout/local/static_kv.py) equals the eager decode
token for token, and logprob for logprob within fp32 rounding, on the CPU (where the static step
runs eagerly; CUDA graphs replay the same step): the full-attention families with adapters, rows
finishing at different times (the batch keeps finished rows, then shrinks), sliced generations,
prefix-cache hits. Families whose cache is not plain full attention say so and decode eagerly.
One engine runs in its own process, built from the config as `lockstep serve` builds it."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lockstep.config import SamplerConfig
from lockstep.engine.types import LoraSpec, SampleParams, SampleRequest, SampleResult
from lockstep.modeling import zoo
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.rollout.config import start_sampler
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.rollout.local.static_kv import StaticBatch

TOLERANCE = 1e-5  # fp32: the static batch attends over more (masked) columns, in other shapes
ADAPTERS = ("a", "b")
SEEDED = SampleParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=7, stop_at_eos=False)


def adapter_dirs(model_dir: Path, served: str, root: Path) -> dict[str, Path]:
    """Two adapters with non-zero B (they change the model), different ranks."""
    lora = LoraModel(load_base_model(model_dir, served, "cpu")[0])
    out = {}
    for n, adapter_id in enumerate(ADAPTERS):
        spec = LoraSpec(rank=4 * (n + 1), alpha=8.0, seed=n)
        lora.add_adapter(adapter_id, spec)
        gen = torch.Generator().manual_seed(100 + n)
        state = {
            k: (torch.randn(v.shape, generator=gen) * 0.5 if ".lora_B." in k else v)
            for k, v in lora.adapter_state(adapter_id).items()
        }
        save_peft_adapter(root / adapter_id, state, spec, served)
        out[adapter_id] = root / adapter_id
    return out


Pair = tuple[LocalSamplingEngine, LocalSamplingEngine]  # eager, static


@pytest.fixture(scope="module", params=["qwen3", "llama", "qwen3_moe"])
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    family = request.param
    model_dir = zoo.ensure_family(family, tmp_path_factory.mktemp("models"))
    served = zoo.served_name(family)
    dirs = adapter_dirs(model_dir, served, tmp_path_factory.mktemp("adapters"))
    engines = []
    for decode in ("eager", "static"):
        engine = LocalSamplingEngine(model_dir, served, decode=decode)  # type: ignore[arg-type]
        for adapter_id, directory in dirs.items():
            engine.load_adapter(adapter_id, directory)
        engines.append(engine)
    eager, static = engines
    assert static.capabilities().decode == "static" and static.capabilities().dtype == "float32"
    assert static._generator.static is not None and eager._generator.static is None
    yield eager, static
    for engine in engines:
        engine.close()


def mixed_batch() -> list[SampleRequest]:
    """Adapters a, b and none; seeded and greedy; rows that stop at 3, 9 and 14 tokens (b's all
    stop first: the static batch drops them as their adapter leaves it)."""
    greedy = SampleParams(max_tokens=3, temperature=0.0, stop_at_eos=False)
    third = SampleParams(max_tokens=9, temperature=1.0, top_k=20, seed=3, stop_at_eos=False)
    return [
        SampleRequest("long", "a", [5, 17, 42, 8, 99, 3], 3, SEEDED),
        SampleRequest("short", "b", [7, 11], 2, greedy),
        SampleRequest("mid", None, [9, 1, 2, 3, 4, 5, 6, 7, 8], 1, third, topk_sample_logprobs=3),
        SampleRequest("scored", "a", [4, 4, 6], 2, third, prompt_logprobs=True),
    ]


def assert_equal(got: SampleResult, want: SampleResult) -> None:
    assert got.request_id == want.request_id
    assert got.error is None and want.error is None
    assert len(got.sequences) == len(want.sequences) > 0
    for a, b in zip(got.sequences, want.sequences, strict=True):
        assert a.tokens == b.tokens and a.stop_reason == b.stop_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=TOLERANCE)
        assert a.topk_ids == b.topk_ids
    if want.prompt_logprobs is not None:
        assert got.prompt_logprobs is not None  # the same prefill: the same numbers
        a, b = torch.tensor(got.prompt_logprobs), torch.tensor(want.prompt_logprobs)
        assert torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def test_static_decode_equals_eager(pair: Pair) -> None:
    eager, static = pair
    want = eager.sample(mixed_batch())
    got = static.sample(mixed_batch())
    lengths = {len(s.tokens) for r in want for s in r.sequences}
    assert lengths == {3, 9, 14}  # rows really finished at different times
    for g, w in zip(got, want, strict=True):
        assert_equal(g, w)


@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3"])  # deepseek_v3: MLA's own K / V dims
def test_other_padded_families_decode_statically(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = zoo.ensure_family(family, tmp_path_factory.mktemp("models"))
    served = zoo.served_name(family)
    requests = [replace(r, adapter_id=None) for r in mixed_batch()]
    results = []
    for decode in ("eager", "static"):
        engine = LocalSamplingEngine(model_dir, served, decode=decode)  # type: ignore[arg-type]
        try:
            assert engine.capabilities().decode == decode
            results.append(engine.sample(requests))
        finally:
            engine.close()
    for got, want in zip(results[1], results[0], strict=True):
        assert_equal(got, want)


def test_the_static_batch_keeps_finished_rows_then_shrinks(pair: Pair) -> None:
    _, static = pair
    generator = static._generator
    with torch.inference_mode():
        generation = generator.start(mixed_batch())
        (live,) = generation.lives
        batch = live.batch
        assert isinstance(batch, StaticBatch)
        assert batch.rows == 8 and batch.capacity == 9 + 14
        generator.advance(generation, 3)  # "short" (b, 2 rows) finished: its adapter left
        assert batch.rows == 6 and batch.column == 9 + 3
        generator.advance(generation, 6)  # "mid" and "scored" finished: 3 of 6 rows live
        assert batch.rows == 3 and batch.column == 9 + 9
        generator.advance(generation, None)
    assert generation.finished


def test_slices_of_a_static_generation_equal_one_eager_call(pair: Pair) -> None:
    eager, static = pair
    long = SampleRequest("long", "a", [5, 17, 42, 8, 99, 3], 2, SEEDED)
    shorts = [
        SampleRequest(
            f"s{i}", "b", [7 + i, 11], 1, SampleParams(max_tokens=4, seed=i, stop_at_eos=False)
        )
        for i in range(2)
    ]
    want = {r.request_id: r for r in eager.sample([long, *shorts])}
    done: dict[str, SampleResult] = {}
    calls = [[long], *([s] for s in shorts)]
    for n in range(100):  # 2 decode steps per call; each short starts between slices
        for result in static.sample_slice(calls[n] if n < len(calls) else [], 2):
            done[result.request_id] = result
        if len(done) == len(want):
            break
    for rid, result in want.items():
        assert_equal(done[rid], result)


def test_prefix_cache_hits_decode_statically(pair: Pair) -> None:
    first = [1, 2, 3, 4, 5, 6, 7, 8]
    rounds = [first, [*first, 30, 31, 32, 33], [*first, 40]]
    results: list[list[SampleResult]] = []
    for engine in pair:
        reused = engine.prefill_counts()[1]
        results.append(
            [
                engine.sample([SampleRequest("p", "a", p, 2, SEEDED, cache_namespace="s")])[0]
                for p in rounds
            ]
        )
        assert engine.prefill_counts()[1] - reused >= 2 * len(first)  # both later rounds hit
    for got, want in zip(results[1], results[0], strict=True):
        assert_equal(got, want)


@pytest.mark.parametrize("family", ["mistral", "gpt_oss"])
def test_families_without_a_plain_cache_say_so_and_decode_eagerly(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = zoo.ensure_family(family, tmp_path_factory.mktemp("models"))
    served = zoo.served_name(family)
    engine = LocalSamplingEngine(model_dir, served, decode="static")
    try:
        caps = engine.capabilities()
        assert caps.decode == "eager" and engine._generator.static is None
        assert (
            caps.decode_fallback is not None and "not plain full attention" in caps.decode_fallback
        )
        (result,) = engine.sample([SampleRequest("r", None, [3, 1, 4], 2, SEEDED)])
        assert [len(s.tokens) for s in result.sequences] == [14, 14]
    finally:
        engine.close()


def test_bfloat16_weights_keep_fp32_adapters_and_logprobs(tmp_path: Path) -> None:
    model_dir = zoo.ensure_family("qwen3", tmp_path / "models")
    served = zoo.served_name("qwen3")
    dirs = adapter_dirs(model_dir, served, tmp_path / "adapters")
    engine = LocalSamplingEngine(model_dir, served, dtype="bfloat16", decode="static")
    try:
        engine.load_adapter("a", dirs["a"])
        assert engine.capabilities().dtype == "bfloat16"
        assert {p.dtype for p in engine._lora.base.parameters() if not p.requires_grad} == {
            torch.bfloat16
        }
        assert {p.dtype for p in engine._lora.adapter_parameters("a")} == {torch.float32}
        request = SampleRequest("r", "a", [3, 1, 4], 2, SEEDED, topk_sample_logprobs=2)
        (result,) = engine.sample([request])
        for seq in result.sequences:
            assert len(seq.tokens) == 14 and seq.topk_logprobs is not None
            for lp, top in zip(seq.logprobs, seq.topk_logprobs, strict=True):
                assert math.isfinite(lp) and top[0] >= lp  # the most likely first
            # fp32 log-softmax of the bf16 logits: not values a bf16 tensor can hold
            held = torch.tensor(seq.logprobs).to(torch.bfloat16).float().tolist()
            assert held != seq.logprobs
    finally:
        engine.close()


def test_the_served_sampler_decodes_statically(tmp_path: Path) -> None:
    """The engine `lockstep serve --sampler-decode static` runs (its own process) equals the
    eager one."""
    model_dir = zoo.ensure_family("qwen3", tmp_path / "models")
    served = zoo.served_name("qwen3")
    requests = [replace(r, adapter_id=None) for r in mixed_batch()]
    eager = LocalSamplingEngine(model_dir, served)
    want = eager.sample(requests)
    eager.close()
    engine = start_sampler(SamplerConfig(decode="static"), model_dir, served, tmp_path)
    try:
        caps = engine.capabilities()
        assert (caps.decode, caps.dtype, caps.decode_fallback) == ("static", "float32", None)
        assert not caps.cuda_graphs  # a CPU
        for g, w in zip(engine.sample(requests), want, strict=True):
            assert_equal(g, w)
    finally:
        engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replays_equal_the_eager_decode(tmp_path: Path) -> None:
    """fp32 on the GPU: the captured and replayed step samples what the eager decode samples."""
    model_dir = zoo.ensure_family("qwen3", tmp_path / "models")
    served = zoo.served_name("qwen3")
    dirs = adapter_dirs(model_dir, served, tmp_path / "adapters")
    engines = [
        LocalSamplingEngine(model_dir, served, device="cuda", dtype="float32", decode=decode)
        for decode in ("eager", "static")
    ]
    try:
        for engine in engines:
            for adapter_id, directory in dirs.items():
                engine.load_adapter(adapter_id, directory)
        eager, static = engines
        assert static.capabilities().cuda_graphs
        generator = static._generator
        with torch.inference_mode():
            generation = generator.start(mixed_batch())
            generator.advance(generation, 2)
            (live,) = generation.lives
            assert isinstance(live.batch, StaticBatch) and live.batch.captured
        assert static.graph_failure() is None
        for got, want in zip(
            static.sample(mixed_batch()), eager.sample(mixed_batch()), strict=True
        ):
            assert_equal(got, want)
    finally:
        for engine in engines:
            engine.close()
