"""A pass that runs out of accelerator memory is retried in smaller micro-batches before any
request fails, and the numbers are those of an undisturbed run. CUDA cannot run here, so a
FAULT-INJECTING engine (`OomInjectingEngine`) raises torch.OutOfMemoryError, as the CUDA
allocator does, from any micro-batch of more than `oom_above` tokens; micro-batches that fit
run (and accumulate gradients) first, so the retry must undo them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.workers.local.micro_batches import padded
from lockstep.workers.local.pass_state import PassState, Row
from lockstep.workers.local.trainer import LocalTrainingEngine

MICRO_BATCH_TOKENS = 256
# Cut at 256 tokens: [200] [120, 104] [64, 56, 32, 24]; over 200 tokens fails, so the first
# micro-batch runs and accumulates before the second one raises.
LENGTHS = [[200, 104, 32], [120, 64, 24], [56]]
OOM_ABOVE = 200


class OomInjectingEngine(LocalTrainingEngine):
    """FAULT INJECTION: the real engine, except that a micro-batch of more than `oom_above`
    padded tokens raises torch.OutOfMemoryError after the ones before it ran."""

    oom_above = 1 << 30
    ooms = 0

    def _micro_batch(
        self,
        rows: list[Row],
        requests: list[PassRequest],
        configs: list[dict[str, float]],
        state: PassState,
        backward: bool,
    ) -> None:
        tokens = sum(padded(r.length) for r in rows)
        if tokens > self.oom_above:
            self.ooms += 1
            raise torch.OutOfMemoryError(f"FAKE out of memory: {tokens} tokens")
        super()._micro_batch(rows, requests, configs, state, backward)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("models"))


def _engine(model_dir: Path, cls: type[LocalTrainingEngine]) -> LocalTrainingEngine:
    engine = cls(model_dir, DEFAULT_MODEL_NAME, micro_batch_tokens=MICRO_BATCH_TOKENS)
    for n in range(len(LENGTHS)):
        engine.create_model(f"m{n}", LoraSpec(rank=4, seed=n))
    return engine


def _requests(lengths: list[list[int]], forward_only: bool = False) -> list[PassRequest]:
    rng = np.random.default_rng(0)
    reqs = []
    for n, rows in enumerate(lengths):
        data = []
        for length in rows:
            tokens = rng.integers(0, 1000, length + 1)
            data.append(Datum(tokens[:-1], {"target_tokens": tokens[1:]}))
        reqs.append(PassRequest(f"r{n}", f"m{n}", "cross_entropy", {}, forward_only, data))
    return reqs


def _run(engine: LocalTrainingEngine) -> list[np.ndarray]:
    """fb over every tenant, one step each, then a forward: every number a tenant sees."""
    seen = [
        np.concatenate([o["logprobs"] for o in r.outputs])
        for r in engine.run_passes(_requests(LENGTHS))
    ]
    steps = engine.optim_step([OptimRequest(f"m{n}", AdamConfig()) for n in range(len(LENGTHS))])
    seen.append(np.array([steps[f"m{n}"]["grad_norm:mean"] for n in range(len(LENGTHS))]))
    seen += [
        np.concatenate([o["logprobs"] for o in r.outputs])
        for r in engine.run_passes(_requests(LENGTHS, forward_only=True))
    ]
    return seen


def test_an_out_of_memory_pass_is_retried_smaller_with_the_same_numbers(model_dir: Path) -> None:
    expected = _run(_engine(model_dir, LocalTrainingEngine))
    faulty = _engine(model_dir, OomInjectingEngine)
    assert isinstance(faulty, OomInjectingEngine)
    faulty.oom_above = OOM_ABOVE
    got = _run(faulty)
    assert faulty.ooms >= 2  # the fused pass and the forward both ran out, then fit smaller
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_row_that_does_not_fit_even_alone_fails_its_request_only(model_dir: Path) -> None:
    too_long = _requests([[8], [8, 300]])  # tenant m1's second datum: 304 tokens alone
    undisturbed = _engine(model_dir, LocalTrainingEngine)
    (want,) = undisturbed.run_passes(too_long[:1])  # m0's request, without m1's
    expected = _run(undisturbed)
    faulty = _engine(model_dir, OomInjectingEngine)
    assert isinstance(faulty, OomInjectingEngine)
    faulty.oom_above = OOM_ABOVE
    got, failed = faulty.run_passes(too_long)  # one call: m1's request fails, m0's runs
    assert failed.error is not None and got.error is None
    assert failed.error.startswith("data[1].model_input: has 300 tokens")
    assert "even alone" in failed.error
    np.testing.assert_allclose(got.metrics["loss:sum"], want.metrics["loss:sum"], rtol=1e-5)
    # m1's failed request left no gradient behind, m0's left its own: the run goes on as if
    # m1's request had never been sent.
    for a, b in zip(_run(faulty), expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
