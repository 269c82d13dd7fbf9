"""What a `lockstep serve` did while a benchmark phase ran, read from outside: its /metrics
(one parser: prometheus_client's), the machine's busy share, the engines' CPU seconds and the
clock's milliseconds per cycle in each of its phases."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

PHASES = ("plan", "dispatch", "collect")  # the clock's own spans (lockstep_cycle_phase_...)


def samples(url: str) -> list[Any]:
    """Every sample a /metrics endpoint exposes now (name, labels, value)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(url: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels`, read now."""
    return summed(samples(url), name, **labels)


def summed(found: list[Any], name: str, **labels: str) -> float:
    """The sum of the samples in `found` named `name` whose labels include `labels`."""
    return float(
        sum(
            s.value
            for s in found
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


def cycles_started(metrics_url: str) -> int:
    """The scheduler's clock-cycle counter (lockstep_cycles_total)."""
    return int(total(metrics_url, "lockstep_cycles_total"))


def clock_seconds(metrics_url: str) -> dict[str, float]:
    """Seconds the clock has spent in each phase of its cycles so far, and how many cycles."""
    found = samples(metrics_url)  # one read: the phases and the count agree
    out = {p: summed(found, "lockstep_cycle_phase_duration_seconds_sum", phase=p) for p in PHASES}
    # Cycles that reached their last phase: counted as the phases' seconds are summed.
    done = summed(found, "lockstep_cycle_phase_duration_seconds_count", phase="collect")
    return out | {"cycles": done}


class Usage:
    """From now until `done()`: the machine's busy share, the engines' cores, and the clock's
    milliseconds per cycle in each phase ("between": outside any cycle's phases)."""

    def __init__(self, engine_seconds: Callable[[], float], metrics_url: str) -> None:
        self.engine_seconds, self.metrics_url = engine_seconds, metrics_url
        self.wall, self.cpu, self.engine = time.perf_counter(), psutil.cpu_times(), engine_seconds()
        self.clock = clock_seconds(metrics_url)

    def done(self) -> dict[str, Any]:
        now, wall = psutil.cpu_times(), time.perf_counter() - self.wall
        total_s = sum(now) - sum(self.cpu)
        idle = (now.idle + now.iowait) - (self.cpu.idle + self.cpu.iowait)
        clock = clock_seconds(self.metrics_url)
        cycles = max(clock["cycles"] - self.clock["cycles"], 1.0)
        phases = {p: (clock[p] - self.clock[p]) / cycles * 1e3 for p in PHASES}
        phases["between"] = wall / cycles * 1e3 - sum(phases.values())
        return {
            "cpu_busy": float(1.0 - idle / total_s) if total_s > 0 else 0.0,
            "engine_cores": (self.engine_seconds() - self.engine) / wall if wall > 0 else 0.0,
            "cycle_ms": phases,
        }
