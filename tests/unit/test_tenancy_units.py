"""Pure parts of tenancy: the keys file, admission under --max-resident-models, the audit log
and usage counters (on a real Redis), age recipients."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from starlette.requests import Request

from lockstep.errors import UserInputError
from lockstep.gateway.app import create_app
from lockstep.gateway.deps import Caller, authenticate
from lockstep.gateway.errors import ApiError
from lockstep.gateway.settings import GatewaySettings
from lockstep.keyring import KeyRing, owner_of
from lockstep.scheduler.observers.accounting import Accounting, AuditEvent, Counter
from lockstep.scheduler.state import encryption
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.residency import Residency
from lockstep.scheduler.state.store import Store


def _ring(tmp_path: Path, text: str) -> KeyRing:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    return KeyRing.load(path)


def test_keys_file_names_quotas_and_revocation(tmp_path: Path) -> None:
    ring = _ring(
        tmp_path,
        '[[key]]\nname = "a"\nkey = "tml-a"\nmax_training_runs = 2\n'
        '[[key]]\nname = "b"\nkey = "tml-b"\nrevoked = true\n',
    )
    app = create_app(GatewaySettings(scheduler_address="x:1", keys_file=tmp_path / "keys.toml"))
    conn = Request({"type": "http", "app": app, "headers": []})
    assert authenticate(conn, "tml-a") == Caller(owner_of("tml-a"), max_training_runs=2)
    with pytest.raises(ApiError, match="'b' is revoked"):
        authenticate(conn, "tml-b")
    with pytest.raises(ApiError, match="invalid API key"):
        authenticate(conn, "tml-c")
    assert ring.lookup("tml-a").max_training_runs == 2  # type: ignore[union-attr]
    assert ring.names() == {owner_of("tml-a"): "a", owner_of("tml-b"): "b"}


@pytest.mark.parametrize(
    "text, problem",
    [
        ('[[key]]\nname = "a"\nkey = "k"\n[[key]]\nname = "a"\nkey = "j"\n', "listed twice"),
        ('[[key]]\nname = "a"\nkey = "k"\nmax_training_runs = -1\n', "must be >= 0"),
        ('[[key]]\nname = "a"\nkey = "k"\nquota = 1\n', "quota"),
        ("[[key]\n", "keys.toml"),
    ],
)
def test_a_bad_keys_file_is_refused_with_the_reason(
    tmp_path: Path, text: str, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        _ring(tmp_path, text)


def _queues(models: list[str]) -> dict[str, list[QueuedOp]]:
    return {m: [QueuedOp(f"r-{m}", m, 1, "forward_backward", 10)] for m in models}


def test_admission_rotates_through_every_waiting_model() -> None:
    """12 ready models, 4 slots: each cycle admits 4, and within 3 cycles all 12 ran."""
    residency = Residency(engine=None, max_resident=4)  # type: ignore[arg-type]
    models = [f"m{i:02d}" for i in range(12)]
    seen: list[set[str]] = []
    for _ in range(3):
        admitted = residency.admit(_queues(models), {m: 1 for m in models})
        assert len(admitted) == 4
        seen.append(set(admitted))
    assert set().union(*seen) == set(models)
    # a model waiting on a gap (its next seq_id has not arrived) takes no slot
    gap = residency.admit(_queues(models), {m: 2 for m in models})
    assert gap == {}
    # no limit: everything passes
    assert len(Residency(engine=None).admit(_queues(models), {})) == 12  # type: ignore[arg-type]


def test_age_recipients_are_checked_per_entry() -> None:
    import pyrage

    good = str(pyrage.x25519.Identity.generate().to_public())
    assert len(encryption.parse_recipients([good])) == 1
    with pytest.raises(UserInputError, match=r"age_encryption_recipients\[1\]"):
        encryption.parse_recipients([good, "age1nope"])
    with pytest.raises(UserInputError, match="at most 10"):
        encryption.parse_recipients([good] * 11)


def test_audit_log_and_usage_are_per_owner_and_ranged(clean_redis: str) -> None:
    async def go() -> None:
        store = Store.from_url(clean_redis)
        acct = Accounting(store, retention_s=3600)
        t0 = time.time()
        await acct.audit("o1", AuditEvent.SESSION_CREATED, session_id="s1")
        await acct.audit("o1", AuditEvent.CHECKPOINT_DELETED, tinker_path="tinker://x")
        await acct.audit("o2", AuditEvent.SESSION_CREATED, session_id="s2")
        await acct.add("o1", "s1", "tiny", {Counter.TOKENS_TRAINED: 7, Counter.STEPS: 1})
        await acct.add("o1", "s1", "tiny", {Counter.TOKENS_TRAINED: 3, Counter.CYCLE_SECONDS: 0.5})
        mine = await acct.audit_log("o1", t0 - 1, time.time() + 1)
        assert [e.event for e in mine] == ["session_created", "checkpoint_deleted"]
        assert [e.event for e in await acct.audit_log("o2", t0 - 1, time.time() + 1)] == [
            "session_created"
        ]
        assert await acct.audit_log("o1", t0 - 3600, t0 - 1) == []
        (bucket,) = await acct.usage("o1", t0 - 1, time.time() + 1)
        assert (bucket.session_id, bucket.tokens_trained, bucket.steps) == ("s1", 10, 1)
        assert bucket.cycle_seconds == pytest.approx(0.5)
        assert await acct.usage("o2", t0 - 1, time.time() + 1) == []
        await store.close()

    asyncio.run(go())


def test_residency_pages_lru_and_frees_ended_models_once_idle(tmp_path: Path) -> None:
    """On the real local engine: paging drops the least recently used model outside the
    cycle; an ended model with queued work stays until its queue drains."""
    from lockstep.engine.types import LoraSpec
    from lockstep.modeling.tiny import ensure_default_model
    from lockstep.workers.local.trainer import LocalTrainingEngine

    engine = LocalTrainingEngine(ensure_default_model(tmp_path / "cache"), "tiny", device="cpu")
    residency = Residency(engine, max_resident=2)
    for m in ("a", "b"):
        engine.create_model(m, LoraSpec(rank=2))
        residency.add(m)

    async def go() -> None:
        await residency.make_room(["a", "c"])  # c comes in: b is the LRU model outside it
        assert (engine.has_model("a"), engine.has_model("b")) == (True, False)
        assert "b" not in residency and residency.page_outs == 1
        residency.end(["a"])
        residency.admit(_queues(["a"]), {"a": 1})  # a still has work queued
        assert await residency.free_ended() == [] and engine.has_model("a")
        residency.admit({}, {})  # drained
        assert await residency.free_ended() == ["a"] and not engine.has_model("a")
        assert len(residency) == 0

    asyncio.run(go())
