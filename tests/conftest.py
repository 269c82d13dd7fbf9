"""Shared fixtures: a real Redis-compatible server process (the binary `lockstep serve` uses),
and the closing of every SDK session a test or fixture opened (`tests.sdk_sessions`)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from lockstep.supervisor import redis_binary
from tests import sdk_sessions


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Generator[None, None, None]:
    """SDK sessions a fixture opens close when it is torn down, before its own teardown code
    (which may stop their server)."""
    with sdk_sessions.collect() as opened:
        yield
    if opened:
        fixturedef.addfinalizer(lambda: sdk_sessions.close(opened))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """SDK sessions a test opens close when it ends, while its servers still run."""
    with sdk_sessions.collect() as opened:
        yield
    sdk_sessions.close(opened)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    directory: Path = tmp_path_factory.mktemp("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--dir",
            str(directory),
            "--appendonly",
            "yes",
            "--save",
            "",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture()
def clean_redis(redis_url: str) -> str:
    redis.Redis.from_url(redis_url).flushall()
    return redis_url
