"""An engine process that misses its call's deadline is killed and reported dead (EngineDied),
and a restart serves again: a wedged engine (a stuck kernel, a hung collective) never holds the
clock. The deadline grows with the tokens a call carries."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lockstep.engine.interface import EngineDied
from lockstep.engine.types import Datum, PassRequest, SampleParams, SampleRequest
from lockstep.workers.process import Deadline, EngineProcess, pass_tokens, sample_tokens


class Sleepy:
    """A FAKE engine whose `nap` takes as long as it is told."""

    def card(self) -> str:
        return "sleepy"

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def close(self) -> None:
        pass


def test_the_deadline_is_a_base_plus_a_share_per_token() -> None:
    assert Deadline().of(10_000) is None  # base 0: no deadline
    assert Deadline(600, 0.05).of(2048) == pytest.approx(600 + 102.4)
    data = [Datum(np.arange(n), {}) for n in (3, 5)]
    assert pass_tokens([PassRequest("r", "m", "cross_entropy", {}, False, data)]) == 8
    sample = SampleRequest("s", None, [1, 2, 3], 4, SampleParams(max_tokens=10))
    assert sample_tokens([sample]) == 3 + 4 * 10


def test_a_call_past_its_deadline_kills_the_engine_and_a_restart_serves_again() -> None:
    proc = EngineProcess(Sleepy, "sleepy", deadline=Deadline(base_s=2.0))
    try:
        assert proc.call("nap", 0.0) == 0.0
        started = time.monotonic()
        with pytest.raises(EngineDied, match="did not finish nap within 2s"):
            proc.call("nap", 600.0)
        assert time.monotonic() - started < 60  # killed at its deadline, not after the nap
        assert not proc.alive()
        proc.restart()
        assert proc.call("nap", 0.0) == 0.0
    finally:
        proc.close()
