"""The added op end to end, in processes whose `lockstep.v1` stubs were regenerated from the
proto with the op's additions (tests/integration/test_adding_an_op.py runs this file so): the
real gateway (its route built from the registry) and the real scheduler in-process (admission,
the planner, dispatch calling the op's engine verb, the durable snapshot, commit, the future) on
a real Redis, with the FAKE arithmetic engine and with the local trainer in its own process."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from safetensors.numpy import load_file

from lockstep.engine.interface import TrainingEngine
from lockstep.gateway.ops import registry as gateway_ops
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.scheduler.ops import registry as scheduler_ops
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.process import NamedFactory, ProcessTrainingEngine
from tests.scheduler_standin import gateway_client

from ..arithmetic_engine import ArithmeticTrainingEngine, features, initial_weights, read_weights
from ..inprocess import Scheduler
from . import gateway_op, scheduler_op
from .engines import SgdArithmetic

TOKENS = [3, 9, 27, 41, 5]
SEED = 5


def test_the_stubs_are_the_regenerated_ones() -> None:
    ops = {f.name for f in pb.SubmitRequest.DESCRIPTOR.oneofs_by_name["op"].fields}
    results = {f.name for f in pb.JobResult.DESCRIPTOR.oneofs_by_name["result"].fields}
    assert "sgd_step" in ops and "sgd_step" in results


@pytest.fixture()
def url(redis_url: str) -> str:
    url = redis_url.rsplit("/", 1)[0] + "/12"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    return url


@contextmanager
def _scheduler(url: str, data: Path, trainer: TrainingEngine) -> Iterator[Scheduler]:
    sched = Scheduler(url, data, trainer=trainer)
    try:
        yield sched
    finally:
        sched.close()
        trainer.close()


def _answer(http: Any, sched: Scheduler, request_id: str) -> dict[str, Any]:
    """The future's answer once the clock has run the request."""
    for _ in range(5):
        sched.tick()
        reply = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if reply.get("type") != "try_again":
            return dict(reply)
    raise AssertionError(f"{request_id} still pending")


def _run(sched: Scheduler, base_model: str) -> tuple[float, str, str]:
    """Create a model, pass, refuse a bad step, save, step, save: (grad_norm, before, after)."""
    with (
        gateway_ops.registered(gateway_op.SgdStep()),  # its line in each registry
        scheduler_ops.registered(scheduler_op.SgdStep()),
        gateway_client(sched.address) as http,
    ):
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        create = {
            "session_id": session,
            "model_seq_id": 0,
            "base_model": base_model,
            "lora_config": {"rank": 1, "seed": SEED},
        }
        created = http.post("/api/v1/create_model", json=create).json()
        model = created["model_id"]
        assert _answer(http, sched, created["request_id"])["model_id"] == model
        datum = {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
            "loss_fn_inputs": {"target_tokens": {"data": TOKENS[1:], "dtype": "int64"}},
        }
        fb = {
            "model_id": model,
            "seq_id": 1,
            "forward_backward_input": {"data": [datum], "loss_fn": "cross_entropy"},
        }
        assert "request_id" in http.post("/api/v1/forward_backward", json=fb).json()
        # The rule is the scheduler op's: the gateway passes the request on, and the refused
        # step still holds its seq_id (the next one runs).
        bad = {"model_id": model, "seq_id": 2, "learning_rate": 3.0}
        refused = http.post("/api/v1/sgd_step", json=bad)
        assert refused.status_code == 400, refused.text
        assert refused.json()["detail"] == "learning_rate: a SGD step takes (0, 1], got 3.0"
        saved = []
        for seq, name in ((3, "before"), (5, "after")):
            save = {"model_id": model, "seq_id": seq, "path": name}
            saved.append(http.post("/api/v1/save_weights", json=save).json()["request_id"])
            if seq == 3:
                step = {"model_id": model, "seq_id": 4, "learning_rate": 0.5}
                stepped = http.post("/api/v1/sgd_step", json=step).json()["request_id"]
        grad_norm = _answer(http, sched, stepped)["grad_norm"]
        paths = [_answer(http, sched, rid)["path"] for rid in saved]
    # Outside the block the registries are as they were: the example route is gone again.
    assert "/api/v1/sgd_step" not in {op.path for op in gateway_ops.ops()}
    assert "sgd_step" not in scheduler_ops.BY_ONEOF
    weights = sched.data_dir / "checkpoints" / model / "weights"
    assert [p.rsplit("/", 1)[1] for p in paths] == ["before", "after"]
    return float(grad_norm), str(weights / "before"), str(weights / "after")


def test_on_a_test_engine(url: str, tmp_path: Path) -> None:
    with _scheduler(url, tmp_path, SgdArithmetic(tmp_path)) as sched:
        grad_norm, before, after = _run(sched, "Fake/arithmetic")
    f = features([TOKENS])
    assert grad_norm == pytest.approx(float(np.linalg.norm(f)), rel=1e-12)
    np.testing.assert_array_equal(read_weights(Path(before)), initial_weights(SEED))
    expected = initial_weights(SEED) - 0.5 * f
    np.testing.assert_allclose(read_weights(Path(after)), expected, rtol=0, atol=1e-12)


def test_on_the_local_trainer_in_its_process(url: str, tmp_path: Path) -> None:
    """The verb crosses the engine process's pipe like every verb: the step moves the adapter
    by exactly learning_rate x the gradient it reports (an Adam step would not)."""
    model_dir = ensure_default_model(tmp_path / "models")
    factory = NamedFactory(
        "tests.integration.adding_an_op.engines:SgdLocalTrainer", (model_dir, DEFAULT_MODEL_NAME)
    )
    with _scheduler(url, tmp_path / "data", ProcessTrainingEngine(factory)) as sched:
        grad_norm, before, after = _run(sched, DEFAULT_MODEL_NAME)
    old, new = (load_file(str(Path(p) / "adapter_model.safetensors")) for p in (before, after))
    assert old.keys() == new.keys()
    moved = math.sqrt(sum(float(np.sum((old[k] - new[k]).astype(np.float64) ** 2)) for k in old))
    assert grad_norm > 0
    assert moved == pytest.approx(0.5 * grad_norm, rel=1e-4)


def test_an_engine_that_does_not_serve_the_verb_refuses_the_op(url: str, tmp_path: Path) -> None:
    with _scheduler(url, tmp_path, ArithmeticTrainingEngine(tmp_path)) as sched:
        with (
            gateway_ops.registered(gateway_op.SgdStep()),
            scheduler_ops.registered(scheduler_op.SgdStep()),
            gateway_client(sched.address) as http,
        ):
            step = {"model_id": "s:train:0", "seq_id": 1, "learning_rate": 0.5}
            refused = http.post("/api/v1/sgd_step", json=step)
    assert refused.status_code == 400
    assert (
        refused.json()["detail"] == "type: sgd_step does not run on the arithmetic training engine"
    )
