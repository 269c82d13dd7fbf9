"""One run_passes call's rows and bookkeeping (the local engine's fused pass).

A request that fails alone (its custom loss fails, its loss is not finite, a row of it runs out
of memory even alone) is recorded here with why; its rows still run in the packed sequence (the
others' numbers stay the same) but add nothing to the backward. If some of its rows already
reached the backward in an earlier micro-batch, its model is "spoiled": the engine restores that
model's gradients and runs its other requests again, and no other tenant runs twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lockstep.engine.types import Datum
from lockstep.training.pass_result import RowLoss


@dataclass
class Row:
    request: int  # index into the run_passes request list
    index: int  # datum index within its request
    datum: Datum
    length: int
    model_id: str


@dataclass
class PassState:
    """One run_passes call's bookkeeping: each row's loss, the requests that failed alone (with
    why), and which requests' rows already reached the backward."""

    outs: dict[tuple[int, int], RowLoss] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)  # request index -> its error
    backwarded: dict[int, str] = field(default_factory=dict)  # request index -> its model
    spoiled: set[str] = field(default_factory=set)  # models holding a failed request's rows

    def start(self) -> None:
        """A new attempt at the pass: gradients are as before it."""
        self.backwarded.clear()
        self.spoiled.clear()

    def fail(self, row: Row, error: str) -> None:
        self.failed.setdefault(row.request, error)
        if row.request in self.backwarded:
            self.spoiled.add(row.model_id)

    def ran(self, rows: list[Row], requests: set[int]) -> None:
        self.backwarded.update((r.request, r.model_id) for r in rows if r.request in requests)
