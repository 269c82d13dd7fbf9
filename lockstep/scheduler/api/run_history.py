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


def steps_of(entries: list[HistoryEntry], steps_committed: int) -> pb.RunHistory:
    """The run's steps, oldest first; the last one is incomplete while its passes wait for
    their optim_step."""
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
    for step in steps.values():
        metrics = join_metrics(step.trained)
        metrics |= {FORWARD_PREFIX + k: v for k, v in join_metrics(step.evaluated).items()}
        metrics |= {STEP_PREFIX + k: v for k, v in (step.stepped or {}).items()}
        out.steps.append(
            pb.StepMetrics(
                step=step.index,
                time=step.time,
                metrics=metrics,
                datums=step.datums,
                tokens=step.tokens,
                complete=step.stepped is not None,
            )
        )
    return out


def _joinable(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.rpartition(":")[2] in _JOINED}
