"""Adding an op is its two modules and a line in each registry: an example op, `sgd_step` (a
plain SGD step, w -= learning_rate * grad), is declared here and driven end to end through the
real gateway (its route is built from the registry) and the real scheduler in-process (its
admission rule, the batched optimizer step, commit, the future), on a real Redis with the FAKE
arithmetic engines.

A new op normally brings its own SubmitRequest field (a proto change); this one reuses the
`optim_step` message (`AdamParams` with its moments off), so its scheduler op stands in for
the op that arrives there while the test runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import redis
from fastapi import Response

from lockstep.engine.types import AdamConfig, OptimRequest
from lockstep.errors import UserInputError
from lockstep.gateway.ops import registry as gateway_ops
from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.schema.requests import SchemaModel
from lockstep.gateway.translate.futures import json_response
from lockstep.gateway.validate import check_id, check_seq_id
from lockstep.scheduler.ops import registry as scheduler_ops
from lockstep.scheduler.ops.base import Claim, Phase, StepOp, SubmitContext, check_seq
from lockstep.scheduler.state.outcome import Outcome
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind
from tests.scheduler_standin import gateway_client

from .arithmetic_engine import features, initial_weights, read_weights
from .inprocess import Scheduler

TOKENS = [3, 9, 27, 41, 5]


# ---------------------------------------------------------------- gateway/ops/sgd_step.py
class SgdStepRequest(SchemaModel):
    model_id: str
    seq_id: int | None = None
    learning_rate: float


class SgdStepRoute(GatewayOp):
    """A plain SGD step of the model's accumulated gradients."""

    name = "sgd_step"
    path = "/api/v1/sgd_step"
    tag = "training"
    oneof = "optim_step"
    result = "optim_step"
    sequenced = True
    body: ClassVar[type[SgdStepRequest]] = SgdStepRequest

    async def submit_request(self, owner: str, body: SgdStepRequest) -> pb.SubmitRequest:
        step = pb.OptimStep(
            model_id=check_id("model_id", body.model_id),  # the address: the gateway's part
            seq_id=check_seq_id(body.seq_id),
            adam=pb.AdamParams(learning_rate=body.learning_rate),
        )
        return pb.SubmitRequest(owner=owner, optim_step=step)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return json_response(rs.OptimStepResult(metrics=dict(result.optim_step.metrics)))


# ---------------------------------------------------------------- scheduler/ops/sgd_step.py
class SgdStep(StepOp):
    oneof = "optim_step"
    kinds: ClassVar[frozenset[OpKind]] = frozenset({OpKind.OPTIM_STEP})

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.optim_step.model_id, req.optim_step.seq_id

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        step = req.optim_step
        await ctx.owned_model(req.owner, step.model_id)
        check_seq(step.seq_id)
        lr = step.adam.learning_rate
        if not (math.isfinite(lr) and 0 < lr <= 1):  # the op's one rule, judged here only
            raise UserInputError("learning_rate", f"a SGD step takes (0, 1], got {lr}")
        return Claim(step.model_id, step.seq_id, OpKind.OPTIM_STEP, 0)

    def phase(self, current: Phase) -> Phase | None:
        return Phase.OPTIM if current <= Phase.PASS else None

    def request(self, model_id: str, req: pb.SubmitRequest) -> OptimRequest:
        lr = req.optim_step.adam.learning_rate
        return OptimRequest(model_id, AdamConfig(learning_rate=lr, beta1=0.0, beta2=0.0))

    def outcome(self, metrics: dict[str, float], snapshot_seq: int | None) -> Outcome:
        result = pb.JobResult(optim_step=pb.OptimStepResult(metrics=metrics))
        return Outcome(result, snapshot_seq=snapshot_seq, replayed=True)


# ---------------------------------------------------------------- the test
@pytest.fixture()
def sched(redis_url: str, tmp_path: Path) -> Iterator[Scheduler]:
    url = redis_url.rsplit("/", 1)[0] + "/12"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    s = Scheduler(url, tmp_path)
    yield s
    s.close()


def _answer(http: Any, sched: Scheduler, request_id: str) -> dict[str, Any]:
    """The future's answer once the clock has run the request."""
    for _ in range(5):
        sched.tick()
        reply = http.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if reply.get("type") != "try_again":
            return dict(reply)
    raise AssertionError(f"{request_id} still pending")


def test_an_op_added_in_two_modules_runs_end_to_end(sched: Scheduler, tmp_path: Path) -> None:
    with (
        gateway_ops.registered(SgdStepRoute()),
        scheduler_ops.registered(SgdStep()),
        gateway_client(sched.address) as http,
    ):
        session = http.post("/api/v1/create_session", json={}).json()["session_id"]
        create = {
            "session_id": session,
            "model_seq_id": 0,
            "base_model": "Fake/arithmetic",
            "lora_config": {"rank": 1, "seed": 5},
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
        refused = http.post(
            "/api/v1/sgd_step", json={"model_id": model, "seq_id": 2, "learning_rate": 3.0}
        )
        assert refused.status_code == 400
        assert refused.json()["detail"] == "learning_rate: a SGD step takes (0, 1], got 3.0"
        step = {"model_id": model, "seq_id": 3, "learning_rate": 0.5}
        stepped = http.post("/api/v1/sgd_step", json=step).json()
        save = {"model_id": model, "seq_id": 4, "path": "after"}
        saved = http.post("/api/v1/save_weights", json=save).json()

        assert "grad_norm:mean" in _answer(http, sched, stepped["request_id"])["metrics"]
        assert _answer(http, sched, saved["request_id"])["path"].endswith("/weights/after")
    expected = initial_weights(5) - 0.5 * features([TOKENS])
    after = read_weights(tmp_path / "checkpoints" / model / "weights" / "after")
    np.testing.assert_allclose(after, expected, rtol=0, atol=1e-12)
    # Outside the block the registries are as they were: the example route is gone again.
    assert "/api/v1/sgd_step" not in {op.path for op in gateway_ops.ops()}
    assert type(scheduler_ops.arriving_as("optim_step")).__name__ == "OptimStep"
