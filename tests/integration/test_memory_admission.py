"""The poison-request case with the REAL local engine: its process runs under an address-space
cap (RLIMIT_AS), its memory budget comes from the room left under that cap, and a tenant's
row longer than that budget fits is refused AT SUBMISSION (INVALID_ARGUMENT, a 400 at the
gateway) naming the datum and the budget; it never reaches the engine, so no engine restart
and no poison search happens. The other tenants of the same cycles get the numbers of an
undisturbed run (each tenant alone on an uncapped engine). Real scheduler in-process, real
Redis, real engine child process."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from lockstep.engine.types import Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.scheduler import translate
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.process import ProcessTrainingEngine

from .inprocess import OWNER, Scheduler, fb
from .limited_trainer import limited_trainer
from .test_cycle_commit import _result, started, url  # noqa: F401

pytestmark = pytest.mark.skipif(
    sys.platform != "linux",
    reason="SKIPPED LOUDLY: the trainer's memory cap needs Linux RLIMIT_AS semantics",
)
HEADROOM = 600 << 20  # address space the capped trainer may still map once torch is loaded
MICRO_BATCH_TOKENS = 128
ADAM = pb.AdamParams(learning_rate=0.01, beta1=0.9, beta2=0.95, eps=1e-8)
LONG_CONTEXT = 1 << 17  # a row this long needs GiBs: no capped budget reaches it
GOOD = [[3, 9, 27, 17, 51, 8, 40], [5, 10, 20, 40, 80, 160, 320, 640, 7]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model with a context far past any row the capped budget fits, so the
    budget (not the context) is what limits a row, whatever a pass costs per token."""
    path = ensure_default_model(tmp_path_factory.mktemp("models"))
    config = path / "config.json"
    fields = json.loads(config.read_text())
    fields["max_position_embeddings"] = LONG_CONTEXT
    config.write_text(json.dumps(fields))
    return path


def _create(sched: Scheduler, session: str, n: int) -> str:
    create = pb.CreateModel(
        session_id=session,
        model_seq_id=n,
        base_model=DEFAULT_MODEL_NAME,
        lora_config=pb.LoraConfig(
            rank=4, seed=10 + n, train_attn=True, train_mlp=True, train_unembed=True
        ),
    )
    rid = sched.stub.Submit(pb.SubmitRequest(owner=OWNER, create_model=create)).request_id
    assert _result(sched, rid).WhichOneof("state") == "result"
    return f"{session}:train:{n}"


def _step(model: str, seq: int) -> pb.SubmitRequest:
    return pb.SubmitRequest(
        owner=OWNER, optim_step=pb.OptimStep(model_id=model, seq_id=seq, adam=ADAM)
    )


def _undisturbed(model_dir: Path, n: int, tokens: list[int]) -> list[float]:
    """loss:sum of fb, step, forward for tenant `n` alone on an uncapped engine."""
    engine = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, micro_batch_tokens=128)
    engine.create_model("m", LoraSpec(rank=4, alpha=32.0, seed=10 + n))
    datum = Datum(
        np.asarray(tokens[:-1], np.int64), {"target_tokens": np.asarray(tokens[1:], np.int64)}
    )

    def run(forward_only: bool) -> float:
        req = PassRequest("r", "m", "cross_entropy", {}, forward_only, [datum])
        return engine.run_passes([req])[0].metrics["loss:sum"]

    first = run(False)
    engine.optim_step([OptimRequest("m", translate.adam_config(ADAM))])
    return [first, run(True)]


@pytest.fixture()
def capped(model_dir: Path) -> Iterator[ProcessTrainingEngine]:
    factory = functools.partial(
        limited_trainer, model_dir, DEFAULT_MODEL_NAME, HEADROOM, MICRO_BATCH_TOKENS
    )
    engine = ProcessTrainingEngine(factory)
    yield engine
    engine.close()


def test_a_row_over_the_capped_trainers_memory_is_refused_at_submission_and_the_others_finish(
    started: list[Scheduler],  # noqa: F811
    url: str,  # noqa: F811
    tmp_path: Path,
    model_dir: Path,
    capped: ProcessTrainingEngine,
) -> None:
    budget = capped.memory_budget()
    context = capped.card().max_context_length
    assert "RLIMIT_AS" in budget.source, budget
    assert max(map(len, GOOD)) < budget.max_row_tokens < context, budget
    sched = Scheduler(url, tmp_path, trainer=capped)
    started.append(sched)
    caps = sched.stub.GetServerCapabilities(pb.CapabilitiesRequest()).models[0]
    assert caps.max_tokens_per_datum == budget.max_row_tokens
    assert caps.trainer_memory_budget_bytes == budget.budget_bytes

    session = sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER)).session_id
    good = [_create(sched, session, n) for n in range(len(GOOD))]
    big = _create(sched, session, len(GOOD))
    info = sched.stub.GetModelInfo(pb.ModelRef(owner=OWNER, model_id=big))
    assert info.max_tokens_per_datum == budget.max_row_tokens

    oversized = [7] * (budget.max_row_tokens + 2)  # max_row_tokens + 1 model-input tokens
    with pytest.raises(grpc.RpcError) as refused:
        sched.stub.Submit(fb(big, 1, oversized))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = refused.value.details() or ""
    assert message.startswith(f"data[0].model_input: has {budget.max_row_tokens + 1} tokens")
    assert f"at most {budget.max_row_tokens} tokens" in message
    assert "memory budget" in message and "RLIMIT_AS" in message

    rids = [
        [sched.stub.Submit(r).request_id for r in (fb(m, 1, t), _step(m, 2), fb(m, 3, t, True))]
        for m, t in zip(good, GOOD, strict=True)
    ]
    # The refused request holds its seq_id: the tenant goes on at seq 2 with a row that fits.
    fits = sched.stub.Submit(fb(big, 2, GOOD[0], True)).request_id
    replies = [[_result(sched, rid) for rid in ids] for ids in rids]
    assert _result(sched, fits).WhichOneof("state") == "result"
    assert capped.process.restarts == 0  # nothing reached the engine that it could not hold
    for n, (fb1, step, fb3) in enumerate(replies):
        assert [r.WhichOneof("state") for r in (fb1, step, fb3)] == ["result"] * 3, n
        got = [r.result.forward_backward.metrics["loss:sum"] for r in (fb1, fb3)]
        assert got == pytest.approx(_undisturbed(model_dir, n, GOOD[n]), rel=1e-5, abs=1e-5)
