"""The state's format stamps (lockstep/scheduler/state/format.py) on a real Redis and a real
directory: a new deployment is stamped, the running format is served, and everything else is
refused naming both versions, with nothing written."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from lockstep.scheduler.state import keys
from lockstep.scheduler.state.format import (
    STAMP_FILE,
    Action,
    Stamp,
    StateRefused,
    prepare_state,
    read_directory,
    redis_label,
)
from lockstep.version import STATE_FORMAT, VERSION


@pytest.fixture()
def r(clean_redis: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(clean_redis)
    yield client
    client.close()


def prepare(url: str, data_dir: Path) -> Any:
    async def go() -> Any:
        client = aioredis.Redis.from_url(url)
        try:
            return await prepare_state(client, data_dir)
        finally:
            await client.aclose()

    return asyncio.run(go())


def snapshot(r: redis.Redis, data_dir: Path) -> tuple[dict[bytes, Any], dict[str, bytes]]:
    """Every key's value (DUMP) and every file's bytes: what 'nothing was changed' compares."""
    values = {k: r.dump(k) for k in r.scan_iter(match="*")}
    files = {
        str(p.relative_to(data_dir)): p.read_bytes() for p in data_dir.rglob("*") if p.is_file()
    }
    return values, files


def test_a_new_deployment_is_stamped_then_served(
    clean_redis: str, r: redis.Redis, tmp_path: Path
) -> None:
    first = prepare(clean_redis, tmp_path)
    assert first.action == Action.NEW
    stamp = Stamp(STATE_FORMAT, VERSION)
    assert r.get(keys.FORMAT) == stamp.encode()
    assert read_directory(tmp_path) == (stamp, False)
    (tmp_path / "state" / "run-1").mkdir(parents=True)
    r.set(keys.model("run-1"), b"{}")
    before = snapshot(r, tmp_path)
    assert prepare(clean_redis, tmp_path).action == Action.SERVE
    assert snapshot(r, tmp_path) == before  # serving writes no stamp again


def _state(r: redis.Redis, data_dir: Path) -> None:
    r.set(keys.model("run-1"), b"{}")
    (data_dir / "checkpoints" / "run-1").mkdir(parents=True)
    (data_dir / "checkpoints" / "run-1" / "adapter.bin").write_bytes(b"weights")


@pytest.mark.parametrize("half", ["redis", "directory"])
def test_a_newer_format_is_refused_untouched(
    clean_redis: str, r: redis.Redis, tmp_path: Path, half: str
) -> None:
    _state(r, tmp_path)
    newer = Stamp(STATE_FORMAT + 1, "9.0.0")
    mine = Stamp(STATE_FORMAT, VERSION)
    r.set(keys.FORMAT, (newer if half == "redis" else mine).encode())
    (tmp_path / STAMP_FILE).write_bytes((mine if half == "redis" else newer).encode())
    before = snapshot(r, tmp_path)
    with pytest.raises(StateRefused) as refused:
        prepare(clean_redis, tmp_path)
    text = str(refused.value)
    assert f"state format {STATE_FORMAT + 1}, written by Lockstep 9.0.0" in text
    assert f"this is Lockstep {VERSION}, which reads state formats up to {STATE_FORMAT}" in text
    assert "Run Lockstep 9.0.0 or newer" in text and "Nothing was changed" in text
    assert snapshot(r, tmp_path) == before


@pytest.mark.parametrize("holder", ["redis", "directory"])
def test_unstamped_state_is_refused_untouched(
    clean_redis: str, r: redis.Redis, tmp_path: Path, holder: str
) -> None:
    if holder == "redis":
        r.set(keys.progress("run-1"), b"1")
    else:
        (tmp_path / "state" / "run-1").mkdir(parents=True)
    before = snapshot(r, tmp_path)
    with pytest.raises(StateRefused, match="without a format stamp.*older than 0.2.0"):
        prepare(clean_redis, tmp_path)
    assert snapshot(r, tmp_path) == before
    assert r.get(keys.FORMAT) is None and not (tmp_path / STAMP_FILE).exists()


def test_halves_that_do_not_belong_together_are_refused(
    clean_redis: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Stamped state in Redis beside an empty data directory (a lost or wrong volume): serving
    it would fail every run's restore, so it is refused, naming both halves."""
    _state(r, tmp_path / "elsewhere")
    r.set(keys.FORMAT, Stamp(STATE_FORMAT, VERSION).encode())
    before = snapshot(r, tmp_path)
    with pytest.raises(StateRefused, match="do not belong together"):
        prepare(clean_redis, tmp_path)
    assert snapshot(r, tmp_path) == before


def test_a_start_stopped_between_the_two_stamps_finishes_them(
    clean_redis: str, r: redis.Redis, tmp_path: Path
) -> None:
    r.set(keys.FORMAT, Stamp(STATE_FORMAT, VERSION).encode())  # the directory's never written
    assert prepare(clean_redis, tmp_path).action == Action.SERVE
    assert read_directory(tmp_path)[0] == Stamp(STATE_FORMAT, VERSION)


def test_a_foreign_stamp_is_refused(clean_redis: str, r: redis.Redis, tmp_path: Path) -> None:
    r.set(keys.FORMAT, b"not json")
    with pytest.raises(StateRefused, match="unreadable state format stamp"):
        prepare(clean_redis, tmp_path)


def test_redis_is_named_without_its_password() -> None:
    label = redis_label("redis://user:s3cret@redis.example:6380/2")
    assert label == "Redis at redis://redis.example:6380/2" and "s3cret" not in label


# ---------------------------------------------------------------- migrations
def _format_1(r: redis.Redis, data_dir: Path) -> None:
    """State as Lockstep 0.2.0 (format 1) leaves it: seq_id claims never expire."""
    r.set(keys.FORMAT, Stamp(1, "0.2.0").encode())
    (data_dir / STAMP_FILE).parent.mkdir(parents=True, exist_ok=True)
    (data_dir / STAMP_FILE).write_bytes(Stamp(1, "0.2.0").encode())
    r.set(keys.seq_claim("m", 1), b"req-done")
    r.hset(keys.job("req-done"), "status", "done")
    r.expire(keys.job("req-done"), 500)
    r.set(keys.seq_claim("m", 2), b"req-gone")  # its result expired
    r.set(keys.seq_claim("m", 3), b"req-queued")
    r.hset(keys.job("req-queued"), "status", "pending")
    r.set(keys.sampler("sess:sample:0"), b"{}")


@pytest.mark.skipif(STATE_FORMAT != 2, reason="the 1 -> 2 migration's own checks")
def test_format_1_is_migrated_once(clean_redis: str, r: redis.Redis, tmp_path: Path) -> None:
    _format_1(r, tmp_path)
    assert prepare(clean_redis, tmp_path).action == Action.MIGRATE
    assert 0 < r.ttl(keys.seq_claim("m", 1)) <= 500  # expires with its result
    assert not r.exists(keys.seq_claim("m", 2))  # its result is gone: a retry is refused
    assert r.ttl(keys.seq_claim("m", 3)) == -1  # expires once its request finishes
    assert r.zscore(keys.SAMPLER_USES, "sess:sample:0") is not None
    stamp = Stamp(2, VERSION)
    assert r.get(keys.FORMAT) == stamp.encode() and read_directory(tmp_path)[0] == stamp
    assert prepare(clean_redis, tmp_path).action == Action.SERVE


@pytest.mark.skipif(STATE_FORMAT != 2, reason="the 1 -> 2 migration's own checks")
def test_a_migration_stopped_between_its_halves_resumes(
    clean_redis: str, r: redis.Redis, tmp_path: Path
) -> None:
    """Redis migrated and stamped, the data directory not yet (a crash in between): the next
    start finishes the directory's half and does not run Redis's again."""
    _format_1(r, tmp_path)
    r.set(keys.FORMAT, Stamp(2, VERSION).encode())
    assert prepare(clean_redis, tmp_path).action == Action.MIGRATE
    assert read_directory(tmp_path)[0] == Stamp(2, VERSION)
    assert r.ttl(keys.seq_claim("m", 1)) == -1  # Redis's half did not run a second time


def test_a_format_older_than_the_migrations_is_refused(
    clean_redis: str, r: redis.Redis, tmp_path: Path
) -> None:
    _state(r, tmp_path)
    for where in (lambda s: r.set(keys.FORMAT, s), (tmp_path / STAMP_FILE).write_bytes):
        where(Stamp(0, "0.0.9").encode())
    before = snapshot(r, tmp_path)
    with pytest.raises(StateRefused, match="state format 0, written by Lockstep 0.0.9.*from"):
        prepare(clean_redis, tmp_path)
    assert snapshot(r, tmp_path) == before


@pytest.mark.skipif(STATE_FORMAT != 2, reason="the 1 -> 2 migration's own checks")
def test_format_1_traces_become_streams(clean_redis: str, r: redis.Redis, tmp_path: Path) -> None:
    from lockstep.scheduler.state.traces import TraceLog

    _format_1(r, tmp_path)
    events = [b'{"ph": "X", "n": 1}', b'{"ph": "X", "n": 2}']
    r.rpush(keys.session_trace("sess"), *events)
    r.expire(keys.session_trace("sess"), 900)
    prepare(clean_redis, tmp_path)
    assert r.type(keys.session_trace("sess")) == b"stream"
    assert 0 < r.ttl(keys.session_trace("sess")) <= 900

    async def read() -> list[bytes]:
        client = aioredis.Redis.from_url(clean_redis)
        try:
            return await TraceLog(client).read("sess")
        finally:
            await client.aclose()

    assert asyncio.run(read()) == events
