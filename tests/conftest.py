"""Shared fixtures: a real Redis-compatible server process (the binary `lockstep serve` uses)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from lockstep.supervisor import redis_binary


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
