"""SglangSamplingEngine against the SGLang stand-in (tests/rollout/sglang_standin.py): a real
HTTP server with SGLang's request/response shapes whose numbers come from Lockstep's own local
sampler, because SGLang cannot run on these machines.

Same shape as the vLLM integration test: two tenants trained by the real LocalTrainingEngine,
one adapter slot (every switch evicts), sampled logprobs equal the trainer's forward, an old
adapter version keeps serving after a newer one is published, and release/resume (colocated
mode) re-send the resident adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lockstep.engine.types import (
    AdamConfig,
    Datum,
    LoraSpec,
    OptimRequest,
    PassRequest,
    SampleParams,
    SampleRequest,
)
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.rollout.remote import ServerError
from lockstep.rollout.sglang import SglangSamplingEngine
from lockstep.workers.local.trainer import LocalTrainingEngine
from tests.rollout.sglang_standin import StandinServer, StandinState

PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> LocalTrainingEngine:
    return LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME)


@pytest.fixture
def standin(model_dir: Path) -> Iterator[tuple[StandinState, str]]:
    state = StandinState(
        LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME, max_adapters=1), max_loaded=1
    )
    with StandinServer(state) as server:
        yield state, server.url


def _pass(
    trainer: LocalTrainingEngine, model_id: str, tokens: list[int], forward_only: bool
) -> np.ndarray:
    arr = np.asarray(tokens, dtype=np.int64)
    datum = Datum(
        arr[:-1], {"target_tokens": arr[1:], "weights": np.ones(len(arr) - 1, dtype=np.float32)}
    )
    out = trainer.run_passes(
        [PassRequest("r", model_id, "cross_entropy", {}, forward_only, [datum])]
    )[0]
    return np.asarray(out.outputs[0]["logprobs"], dtype=np.float64)


def _train_and_export(
    trainer: LocalTrainingEngine,
    model_id: str,
    steps: int,
    directory: Path,
    seed: int | None = None,
) -> None:
    if seed is not None:
        trainer.create_model(model_id, LoraSpec(rank=8, alpha=16, seed=seed))
    for _ in range(steps):
        _pass(trainer, model_id, list(range(10, 40)), forward_only=False)
        trainer.optim_step([OptimRequest(model_id, AdamConfig(learning_rate=2e-2))])
    trainer.export_adapter(model_id, directory)


def _sample(engine: SglangSamplingEngine, adapter: str) -> list[tuple[list[int], list[float]]]:
    req = SampleRequest(
        "q",
        adapter,
        PROMPT,
        2,
        SampleParams(max_tokens=5, seed=3),
        prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=2,
    )
    result = engine.sample([req])[0]
    assert result.error is None, result.error
    assert result.prompt_logprobs is not None and np.isnan(result.prompt_logprobs[0])
    assert result.topk_prompt is not None and len(result.topk_prompt[1] or []) == 2
    return [(s.tokens, s.logprobs) for s in result.sequences]


def test_sglang_engine_against_standin(
    trainer: LocalTrainingEngine, tmp_path: Path, standin: tuple[StandinState, str], model_dir: Path
) -> None:
    state, url = standin
    for name, seed in (("a", 1), ("b", 2)):
        _train_and_export(trainer, name, 3, tmp_path / f"{name}-v1", seed=seed)
    engine = SglangSamplingEngine.attach(url, model_dir, DEFAULT_MODEL_NAME, max_adapters=1)
    engine.load_adapter("a-v1", tmp_path / "a-v1")
    engine.load_adapter("b-v1", tmp_path / "b-v1")  # evicts a-v1 (one slot)
    assert engine.resident_adapters() == ["b-v1"]

    for _ in range(2):  # alternate: each switch unloads one adapter and reloads the other
        for name in ("a", "b"):
            sequences = _sample(engine, f"{name}-v1")
            assert len(sequences) == 2
            for tokens, logprobs in sequences:
                assert len(tokens) == len(logprobs) == 5
                fwd = _pass(trainer, name, PROMPT + tokens, forward_only=True)
                np.testing.assert_allclose(logprobs, fwd[len(PROMPT) - 1 :], atol=1e-4)
    assert state.calls.count("unload_lora_adapter") >= 4
    assert len(state.loaded) == 1

    # Versioned: tenant a publishes v2; v1 still serves the old weights.
    old = _pass(trainer, "a", PROMPT + [11, 12], forward_only=True)
    _train_and_export(trainer, "a", 2, tmp_path / "a-v2")
    new = _pass(trainer, "a", PROMPT + [11, 12], forward_only=True)
    engine.load_adapter("a-v2", tmp_path / "a-v2")
    for adapter, want in (("a-v1", old), ("a-v2", new)):
        req = SampleRequest(
            "p", adapter, PROMPT + [11, 12], 1, SampleParams(max_tokens=1), prompt_logprobs=True
        )
        got = engine.sample([req])[0].prompt_logprobs
        assert got is not None
        np.testing.assert_allclose(got[1:], want, atol=1e-4)
    assert np.abs(old - new).max() > 1e-3

    # Colocated phases: released -> the server cannot generate; resumed -> adapter re-sent.
    loads = state.calls.count("load_lora_adapter")
    engine.release()
    with pytest.raises(ServerError):
        _sample(engine, "a-v2")
    engine.resume()
    assert state.calls.count("load_lora_adapter") == loads + 1
    assert _sample(engine, "a-v2")

    # An unknown adapter fails alone, naming the field.
    unknown = SampleRequest("y", "nope", PROMPT, 1, SampleParams(max_tokens=2))
    good = SampleRequest("z", "b-v1", PROMPT, 1, SampleParams(max_tokens=2))
    results = engine.sample([unknown, good])
    assert results[0].error is not None and "adapter_id" in results[0].error
    assert results[1].error is None and len(results[1].sequences[0].tokens) == 2


def test_colocated_training_phase_releases_and_resumes_the_sampler(
    trainer: LocalTrainingEngine,
    tmp_path: Path,
    standin: tuple[StandinState, str],
    model_dir: Path,
    clean_redis: str,
) -> None:
    """The scheduler's hook (SamplingLane.training_phase, entered by the clock around each
    dispatch) releases the sampler before training and resumes it after; while training, the
    lane holds the sampler so no sample reaches a released server."""
    import asyncio

    from lockstep.observability import metrics
    from lockstep.scheduler.cycle.sampling_lane import SamplingLane
    from lockstep.scheduler.state.futures import FutureBoard
    from lockstep.scheduler.state.store import Store

    state, url = standin
    _train_and_export(trainer, "c", 1, tmp_path / "c-v1", seed=3)
    engine = SglangSamplingEngine.attach(url, model_dir, DEFAULT_MODEL_NAME, max_adapters=1)
    releases = metrics.SAMPLER_MEMORY_TRANSITIONS.labels("release")._value.get()

    async def scenario() -> list[str]:
        store = Store.from_url(clean_redis)
        lane = SamplingLane(store, engine, FutureBoard(store), colocate=True)
        lane.publish([("c-v1", tmp_path / "c-v1")])
        await asyncio.sleep(0.5)  # the publish runs off the caller's path
        async with lane.training_phase():
            seen = list(state.calls)
            await asyncio.sleep(0)
        await store.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen[-1] == "release_memory_occupation" and state.released is False
    assert state.calls[-1] == "load_lora_adapter"  # resumed, then the adapter re-sent
    assert "resume_memory_occupation" in state.calls
    assert metrics.SAMPLER_MEMORY_TRANSITIONS.labels("release")._value.get() == releases + 1
    assert _sample(engine, "c-v1")
