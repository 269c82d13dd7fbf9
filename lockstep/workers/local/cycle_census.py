"""One packed clock cycle of the local trainer, counted op by op (`modeling.op_census`): what
`benchmarks/op_census.py` reports per family and K, and what tests/unit/test_op_census.py holds
to (ops per decoder layer do not grow with the number of tenants)."""

from __future__ import annotations

from typing import Any

import numpy as np

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.op_census import OpCensus, Region
from lockstep.workers.local.trainer import LocalTrainingEngine


def census_cycle(
    engine: LocalTrainingEngine,
    tenants: int,
    tokens: int = 64,
    rank: int = 16,
    warm: bool = True,
) -> dict[str, Any]:
    """K = `tenants` fresh adapters (rank `rank`, train_attn/mlp, one datum of `tokens` tokens
    each): with `warm`, a warm-up cycle (their Adam state made, as in any cycle after a
    tenant's first; without, the counted optimizer step makes it), then ONE counted cycle:
    `run_passes` (every tenant's datum in one fused forward + backward) and `optim_step` (one
    batched AdamW). The adapters are deleted afterwards.

    Raises:
        RuntimeError: a request failed (the census would count a different cycle).
    """
    ids = [f"census-{i}" for i in range(tenants)]
    rng = np.random.default_rng(0)
    vocab = engine.card().vocab_size
    passes = []
    for i, model_id in enumerate(ids):
        engine.create_model(model_id, LoraSpec(rank=rank, alpha=2.0 * rank, seed=i))
        t = rng.integers(1, vocab, size=tokens + 1)
        datum = Datum(
            tokens=t[:-1].astype(np.int64),
            loss_inputs={"target_tokens": t[1:].astype(np.int64), "weights": np.ones(tokens, "f4")},
        )
        passes.append(PassRequest(f"census-{i}", model_id, "cross_entropy", {}, False, [datum]))
    optims = [OptimRequest(model_id, AdamConfig(learning_rate=1e-3)) for model_id in ids]
    try:
        if warm:
            _check(engine.run_passes(passes))
            engine.optim_step(optims)
        census = OpCensus(engine._model)
        with census:
            with census.region(Region.PASS):
                results = engine.run_passes(passes)
            with census.region(Region.OPTIMIZER):
                engine.optim_step(optims)
        _check(results)
    finally:
        for model_id in ids:
            engine.delete_model(model_id)
    return census.summary(tenants * tokens)


def _check(results: list[Any]) -> None:
    failed = [r.error for r in results if r.error]
    if failed:
        raise RuntimeError(f"a census request failed: {failed[0]}")
