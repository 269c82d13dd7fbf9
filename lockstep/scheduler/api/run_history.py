"""A run's metrics per optimizer step, from its committed history (`keys.history`).

The history keeps each committed forward, forward_backward and optim_step's metrics in seq_id
order; the progress hash counts the optim_steps committed. A step is the passes since the
previous optim_step and the optim_step that ends it. Indexes are counted back from the newest
entry, so a history trimmed at its head (`commit.HISTORY_KEPT`) keeps its step numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.engine.parts import join_metrics
from lockstep.scheduler.state.records import HistoryEntry
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

FORWARD_PREFIX = "forward/"  # forward-only passes (evaluations) beside the trained ones
STEP_PREFIX = "optim_step/"  # the optimizer step's own metrics (e.g. grad_norm:mean)
_JOINED = ("sum", "mean")  # reductions join_metrics knows; others are left out of a step


@dataclass
class _Step:
    index: int
    trained: list[tuple[dict[str, float], int]] = field(default_factory=list)
    evaluated: list[tuple[dict[str, float], int]] = field(default_factory=list)
    stepped: dict[str, float] | None = None
    time: float = 0.0
    datums: int = 0
    tokens: int = 0


def steps_of(
    entries: list[HistoryEntry], steps_committed: int, most_points: int = 0
) -> pb.RunHistory:
    """The run's steps, oldest first; the last one is incomplete while its passes wait for
    their optim_step. With `most_points`, runs of consecutive steps are sent as their means
    (each point says how many steps it is), at most that many points."""
    index = steps_committed
    numbered: list[tuple[int, HistoryEntry]] = []
    for entry in reversed(entries):
        if entry.kind == OpKind.OPTIM_STEP:
            index -= 1
        numbered.append((index, entry))
    steps: dict[int, _Step] = {}
    for i, entry in reversed(numbered):
        step = steps.setdefault(i, _Step(i))
        step.time = max(step.time, entry.time)
        if entry.kind == OpKind.OPTIM_STEP:
            step.stepped = entry.metrics
        elif entry.kind == OpKind.FORWARD:
            step.evaluated.append((_joinable(entry.metrics), entry.datums))
        else:
            step.trained.append((_joinable(entry.metrics), entry.datums))
            step.datums += entry.datums
            step.tokens += entry.tokens
    out = pb.RunHistory(first_step=min(steps, default=steps_committed))
    joined = [(step, _metrics(step)) for step in steps.values()]
    size = -(-len(joined) // most_points) if most_points > 0 else 1
    for i in range(0, len(joined), size):
        out.steps.append(_point(joined[i : i + size]))
    return out


def _metrics(step: _Step) -> dict[str, float]:
    metrics = join_metrics(step.trained)
    metrics |= {FORWARD_PREFIX + k: v for k, v in join_metrics(step.evaluated).items()}
    return metrics | {STEP_PREFIX + k: v for k, v in (step.stepped or {}).items()}


def _point(run: list[tuple[_Step, dict[str, float]]]) -> pb.StepMetrics:
    """Consecutive steps as one point: the last step's number and time, each metric's mean
    over the steps that have it, datums and tokens summed."""
    last = run[-1][0]
    if len(run) == 1:
        metrics = run[0][1]
    else:
        sums: dict[str, list[float]] = {}
        for _, m in run:
            for k, v in m.items():
                sums.setdefault(k, []).append(v)
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
    return pb.StepMetrics(
        step=last.index,
        time=last.time,
        metrics=metrics,
        datums=sum(s.datums for s, _ in run),
        tokens=sum(s.tokens for s, _ in run),
        complete=last.stepped is not None,
        steps=len(run),
    )


def _joinable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.rpartition(":")[2] in _JOINED}
