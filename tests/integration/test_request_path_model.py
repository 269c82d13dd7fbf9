"""Model-based test of the request path: the real scheduler (gRPC service, Submissions, Redis
store, planner, clock, dispatcher, sampling lane) on a real Redis, with the deterministic FAKE
engines of `arithmetic_engine` (for speed and exact expectations).

Hypothesis drives random interleavings, over several models, of good passes, refused passes,
retries with the same and with a different payload, dropped responses, concurrent duplicates,
seq_id gaps filled late, steps, saves, loads, samples and engine deaths -- and of clock cycles:
the test runs each cycle itself (`tick`), so which requests share a cycle is chosen by the test,
not by timing, and a failing interleaving replays exactly. A reference model of each tenant
applies its accepted requests one by one, in seq_id order. Invariants:
  - every future completes within a bounded number of cycles;
  - each request's result is the reference's at its place in the model's order (so steps are
    applied exactly once and in order), and each model's final weights equal the reference's;
  - a model's progress (next_seq, snapshot_seq) never decreases.
CI runs a bounded number of examples; LOCKSTEP_SOAK_EXAMPLES=N runs a longer soak.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from lockstep.v1 import scheduler_pb2 as pb

from .arithmetic_engine import (
    VOCAB,
    features,
    initial_weights,
    read_weights,
    weights_token,
)
from .inprocess import OWNER, Scheduler, fb

MAX_CYCLES = 50  # a future still pending after this many cycles of its own is stuck
EXAMPLES = int(os.environ.get("LOCKSTEP_SOAK_EXAMPLES", "12"))
STEPS = 40 if "LOCKSTEP_SOAK_EXAMPLES" in os.environ else 25


@pytest.fixture(scope="module")
def scheduler(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scheduler]:
    import redis

    url = redis_url.rsplit("/", 1)[0] + "/7"  # a database of its own on the shared server
    redis.Redis.from_url(url).flushdb()
    sched = Scheduler(url, tmp_path_factory.mktemp("model-based"))
    yield sched
    sched.close()


@dataclass
class Expect:
    """What a request's future must answer (checked once it completes)."""

    kind: str
    loss: float | None = None  # forward / forward_backward: the reference loss
    token: int | None = None  # sample: the token of the weights its sampler was made from


@dataclass
class Tenant:
    """The reference model of one tenant: its accepted requests applied one by one."""

    model_id: str
    w: np.ndarray
    g: np.ndarray = field(default_factory=lambda: np.zeros(4))
    seq: int = 1  # the next seq_id to use (create_model took 0)
    last: pb.SubmitRequest | None = None  # the last accepted request (for retries)
    saved: dict[str, np.ndarray] = field(default_factory=dict)
    progress: tuple[int, int] = (0, -1)


TOKENS = st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=8)


class RequestPath(RuleBasedStateMachine):
    sched: Scheduler
    counter = 0

    models = Bundle("models")

    def __init__(self) -> None:
        super().__init__()
        self.futures: dict[str, Expect] = {}
        self.tenants: dict[str, Tenant] = {}
        self.samplers = 0
        self.passes_at_death = -1  # the trainer's passes_run when a death was last injected
        session = self.sched.stub.CreateSession(pb.CreateSessionRequest(owner=OWNER))
        self.session_id = session.session_id

    # -------------------------------------------------------------- helpers
    def submit(self, req: pb.SubmitRequest) -> str:
        return str(self.sched.stub.Submit(req, timeout=30).request_id)

    def refused(self, req: pb.SubmitRequest) -> str:
        with pytest.raises(grpc.RpcError) as info:
            self.submit(req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        return str(info.value.details())

    def accept(self, t: Tenant, req: pb.SubmitRequest, expect: Expect) -> str:
        rid = self.submit(req)
        assert rid not in self.futures
        self.futures[rid] = expect
        t.last, t.seq = req, t.seq + 1
        return rid

    def wait(self, rid: str) -> pb.FutureReply:
        """Run cycles until `rid` completes; fail if it is still pending after MAX_CYCLES."""
        for _ in range(MAX_CYCLES):
            poll = 2.0 if self.futures.get(rid, Expect("")).kind == "sample" else 0.0
            reply = self.sched.stub.RetrieveFuture(
                pb.RetrieveFutureRequest(owner=OWNER, request_id=rid, timeout_seconds=poll),
                timeout=30,
            )
            if reply.WhichOneof("state") != "try_again":
                return reply
            self.sched.tick()
        raise AssertionError(f"future {rid} still pending after {MAX_CYCLES} cycles")

    # -------------------------------------------------------------- rules
    @initialize(target=models)
    def first_model(self) -> str:
        return self.new_model_id()

    @rule(target=models)
    def new_model(self) -> str:
        return self.new_model_id()

    def new_model_id(self) -> str:
        RequestPath.counter += 1
        n, seed = len(self.tenants), RequestPath.counter
        create = pb.CreateModel(
            session_id=self.session_id,
            model_seq_id=n,
            base_model="Fake/arithmetic",
            optimizer_type="adamw",
            lora_config=pb.LoraConfig(rank=1, seed=seed, train_mlp=True),
        )
        rid = self.submit(pb.SubmitRequest(owner=OWNER, create_model=create))
        model_id = f"{self.session_id}:train:{n}"
        self.futures[rid] = Expect("create_model")
        self.tenants[model_id] = Tenant(model_id, initial_weights(seed))
        return model_id

    def _pass(self, t: Tenant, tokens: list[int], forward_only: bool = False) -> pb.SubmitRequest:
        req = fb(t.model_id, t.seq, tokens, forward_only)
        f = features([tokens])
        self.accept(
            t, req, Expect("forward" if forward_only else "forward_backward", loss=float(t.w @ f))
        )
        if not forward_only:
            t.g = t.g + f
        return req

    @rule(model=models, tokens=TOKENS)
    def good_pass(self, model: str, tokens: list[int]) -> None:
        self._pass(self.tenants[model], tokens)

    @rule(model=models, tokens=TOKENS)
    def forward_only(self, model: str, tokens: list[int]) -> None:
        self._pass(self.tenants[model], tokens, forward_only=True)

    @rule(model=models, tokens=TOKENS, bad=st.integers(VOCAB, 10**6))
    def refused_pass(self, model: str, tokens: list[int], bad: int) -> None:
        t = self.tenants[model]
        assert "token" in self.refused(fb(model, t.seq, [*tokens, bad]))
        t.seq += 1  # the refused request still holds its seq_id

    @rule(model=models, lr=st.sampled_from([0.5, 0.1, 0.01]))
    def step(self, model: str, lr: float) -> None:
        t = self.tenants[model]
        req = pb.SubmitRequest(
            owner=OWNER,
            optim_step=pb.OptimStep(
                model_id=model,
                seq_id=t.seq,
                adam=pb.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-12),
            ),
        )
        self.accept(t, req, Expect("optim_step"))
        t.w, t.g = t.w - lr * t.g, np.zeros(4)

    @rule(model=models)
    def retry_same(self, model: str) -> None:
        """A retry (same seq_id, same payload) is the same request: nothing runs twice."""
        t = self.tenants[model]
        if t.last is not None:
            rid = self.submit(t.last)
            assert rid in self.futures

    @rule(model=models, tokens=TOKENS)
    def retry_with_another_payload(self, model: str, tokens: list[int]) -> None:
        t = self.tenants[model]
        if t.last is not None and t.last.WhichOneof("op") == "forward_backward":
            other = fb(model, t.last.forward_backward.seq_id, [*tokens, 1, 2, 3])
            assert "seq_id" in self.refused(other)

    @rule(model=models, tokens=TOKENS)
    def dropped_response(self, model: str, tokens: list[int]) -> None:
        """The reply to a submit is lost; the client sends it again and gets the same id."""
        t = self.tenants[model]
        req = self._pass(t, tokens)
        rid = next(reversed(self.futures))
        assert self.submit(req) == rid

    @rule(model=models, tokens=TOKENS)
    def concurrent_duplicates(self, model: str, tokens: list[int]) -> None:
        t = self.tenants[model]
        req = fb(model, t.seq, tokens)
        with ThreadPoolExecutor(3) as pool:
            rids = set(pool.map(self.submit, [req] * 3))
        assert len(rids) == 1, rids
        f = features([tokens])
        self.futures[rids.pop()] = Expect("forward_backward", loss=float(t.w @ f))
        t.g, t.last, t.seq = t.g + f, req, t.seq + 1

    @rule(model=models, first=TOKENS, second=TOKENS)
    def gap_filled_late(self, model: str, first: list[int], second: list[int]) -> None:
        """seq k+1 arrives before seq k (the SDK sends a call's lowest chunk last)."""
        t = self.tenants[model]
        early = fb(model, t.seq + 1, second)
        late = fb(model, t.seq, first)
        f1, f2 = features([first]), features([second])
        rid_early = self.submit(early)
        rid_late = self.submit(late)
        self.futures[rid_late] = Expect("forward_backward", loss=float(t.w @ f1))
        self.futures[rid_early] = Expect("forward_backward", loss=float(t.w @ f2))
        t.g, t.last, t.seq = t.g + f1 + f2, early, t.seq + 2

    @rule(model=models)
    def save(self, model: str) -> None:
        t = self.tenants[model]
        name = f"c{t.seq}"
        req = pb.SubmitRequest(
            owner=OWNER,
            save_weights=pb.SaveWeights(
                model_id=model, seq_id=t.seq, kind=pb.CHECKPOINT_KIND_TRAINING, name=name
            ),
        )
        self.accept(t, req, Expect("save"))
        t.saved[name] = t.w.copy()

    @rule(model=models, data=st.data())
    def load(self, model: str, data: st.DataObject) -> None:
        t = self.tenants[model]
        if not t.saved:
            return
        name = data.draw(st.sampled_from(sorted(t.saved)))
        for rid, e in list(self.futures.items()):  # its files must exist to be accepted
            if e.kind == "save":
                self.wait(rid)
        req = pb.SubmitRequest(
            owner=OWNER,
            load_weights=pb.LoadWeights(
                model_id=model,
                seq_id=t.seq,
                path=f"tinker://{model}/weights/{name}",
                optimizer=True,
            ),
        )
        self.accept(t, req, Expect("load"))
        t.w, t.g = t.saved[name].copy(), np.zeros(4)

    @rule(model=models)
    def sample(self, model: str) -> None:
        t = self.tenants[model]
        self.samplers += 1
        save = pb.SubmitRequest(
            owner=OWNER,
            save_weights=pb.SaveWeights(
                model_id=model,
                seq_id=t.seq,
                kind=pb.CHECKPOINT_KIND_SAMPLER,
                sampling_session_seq_id=self.samplers,
            ),
        )
        rid = self.accept(t, save, Expect("save"))
        reply = self.wait(rid)
        assert reply.WhichOneof("state") == "result", reply
        sampler_id = reply.result.save.sampling_session_id
        sample = pb.SubmitRequest(
            owner=OWNER,
            sample=pb.Sample(
                sampling_session_id=sampler_id,
                seq_id=0,
                prompt_tokens=[1, 2],
                num_samples=1,
                params=pb.SamplingParams(max_tokens=1, top_p=1.0, top_k=-1),
            ),
        )
        self.futures[self.submit(sample)] = Expect("sample", token=weights_token(t.w))

    @rule()
    def tick(self) -> None:
        self.sched.tick()

    @rule(model=models, tokens=TOKENS, bad=st.integers(VOCAB, 10**6))
    def refused_then_pipelined_step(self, model: str, tokens: list[int], bad: int) -> None:
        """The reported hang, submitted as one burst: refused pass, good pass, optim_step."""
        self.refused_pass(model, tokens, bad)
        self.good_pass(model, tokens)
        self.step(model, 0.1)

    @precondition(lambda self: self.sched.trainer.passes_run > self.passes_at_death)
    @rule()
    def engine_dies(self) -> None:
        """The trainer dies at its next pass: the cycle is abandoned and re-run on a restarted
        engine, which restores every model from its snapshot and replay log. Once a pass has
        run since the last death: the same pass killing the engine twice is a poison request,
        refused by design (test_poison_requests.py), not a death this model expects."""
        self.passes_at_death = self.sched.trainer.passes_run
        self.sched.trainer.die_at_next_pass = True

    # -------------------------------------------------------------- invariants
    @invariant()
    def progress_never_decreases(self) -> None:
        for t in self.tenants.values():
            next_seq, snap = self.sched.run(self.sched.store.cycles.progress(t.model_id))
            now = (next_seq, -1 if snap is None else snap)
            assert now[0] >= t.progress[0] and now[1] >= t.progress[1], (t.model_id, now)
            t.progress = now

    def teardown(self) -> None:
        self.sched.trainer.die_at_next_pass = False
        for rid, expect in list(self.futures.items()):
            reply = self.wait(rid)
            assert reply.WhichOneof("state") == "result", (expect, reply)
            if expect.loss is not None:
                loss = reply.result.forward_backward.metrics["loss:sum"]
                assert loss == pytest.approx(expect.loss, rel=1e-12, abs=1e-12), (rid, expect)
            if expect.token is not None:
                tokens = np.frombuffer(reply.result.sample.sequences[0].tokens, "<i4")
                assert tokens.tolist() == [expect.token]
        for t in self.tenants.values():  # the final weights, through a last save
            self.save(t.model_id)
            name = f"c{t.seq - 1}"
            rid = next(reversed(self.futures))
            assert self.wait(rid).WhichOneof("state") == "result"
            final = read_weights(
                self.sched.data_dir / "checkpoints" / t.model_id / "weights" / name
            )
            np.testing.assert_allclose(final, t.w, rtol=0, atol=1e-12)


def test_the_request_path_keeps_its_invariants(scheduler: Scheduler) -> None:
    RequestPath.sched = scheduler
    run_state_machine_as_test(
        RequestPath,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        ),
    )
    assert scheduler.trainer.restarts > 0, "no example exercised an engine death"
