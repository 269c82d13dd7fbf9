"""Each engine process takes its share of the host's cores (torch intra-op threads), so the
trainer and the sampler running at once never oversubscribe the host; OMP_NUM_THREADS, when an
operator sets it, decides instead."""

from __future__ import annotations

import os

import pytest

from lockstep.workers.process import ENGINE_PROCESSES, EngineProcess


class Threads:
    """A FAKE engine that reports its process's torch threads."""

    def threads(self) -> int:
        import torch

        return int(torch.get_num_threads())

    def close(self) -> None:
        pass


def _child_threads() -> int:
    proc = EngineProcess(Threads, "threads")
    try:
        return int(proc.call("threads"))
    finally:
        proc.close()


def test_an_engine_process_takes_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert _child_threads() == max(1, cores // ENGINE_PROCESSES)


def test_omp_num_threads_decides_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("one core: the share and the setting are both 1 thread")
    monkeypatch.setenv("OMP_NUM_THREADS", str(cores))  # torch reads at most one per core
    assert _child_threads() == cores
