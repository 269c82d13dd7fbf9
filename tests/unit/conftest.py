"""Fixtures shared by the gateway route tests: one stand-in scheduler per module, reset per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.scheduler_standin import StandInScheduler, running_standin


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[StandInScheduler, str]]:
    with running_standin() as running:
        yield running


@pytest.fixture
def sched(standin: tuple[StandInScheduler, str]) -> StandInScheduler:
    standin[0].reset()
    return standin[0]
