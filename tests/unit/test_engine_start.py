"""Engine processes start side by side: one started `after` another loads its modules at once but
builds its engine only once the other is up (the trainer measures the memory left to it before
the sampler takes any), and is stopped, with the error, if the other fails to start."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from concurrent.futures import Future

import pytest

from lockstep.engine.interface import EngineDied
from lockstep.workers.process import EngineProcess, NamedFactory


class Stamp:
    """A FAKE engine that remembers when it was built (CLOCK_MONOTONIC: one clock for every
    process of the host)."""

    def __init__(self) -> None:
        self.built = time.monotonic()

    def built_at(self) -> float:
        return self.built

    def close(self) -> None:
        pass


def test_an_engine_started_after_another_is_built_once_that_one_is_up() -> None:
    up: Future[None] = Future()
    started: list[EngineProcess] = []
    thread = threading.Thread(
        target=lambda: started.append(
            EngineProcess(NamedFactory(f"{__name__}:Stamp"), "second", after=up)
        )
    )
    thread.start()
    released = time.monotonic()
    up.set_result(None)
    thread.join(120)
    (proc,) = started
    try:
        assert proc.call("built_at") >= released
    finally:
        proc.close()


def test_an_engine_whose_predecessor_failed_is_stopped_with_its_error() -> None:
    up: Future[None] = Future()
    up.set_exception(EngineDied("the trainer did not start"))
    with pytest.raises(EngineDied, match="the trainer did not start"):
        EngineProcess(Stamp, "second", after=up)
    assert "second" not in [child.name for child in mp.active_children()]
