"""Partners: tenants that share cycles keep sharing them when the machine is busy.

Tenants whose clients step in lock-step (each sends its next step once its last one is answered)
submit at nearly the same moment, and a triggered clock gathers for `--clock-gather` seconds
before it plans. On a busy machine the spread between their submissions (client, gateway and
scheduler all slowed down) outgrows that gather: the first one's step runs alone, the other's in
the next cycle, and from then on they alternate: twice the cycles, each half full.

So the models that ran passes together in the last cycle are partners, and a cycle about to run
some partners' passes while another partner has nothing queued waits for it, at most about one
cycle's length (the recent partnered cycles' mean time, so the wait grows with the machine's
slowness, never over `MAX_WAIT_S`). A partner that does not come in that time is no partner any
more: a tenant that stopped costs its neighbours one such wait, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lockstep.scheduler.planner import CyclePlan

MAX_WAIT_S = 1.0
DECAY = 0.8  # weight of older partnered cycles in the mean cycle time


class Partners:
    def __init__(self) -> None:
        self.models: frozenset[str] = frozenset()
        self.cycle_s: float | None = None  # mean time of recent cycles that had partners

    def after(self, plan: CyclePlan, seconds: float) -> None:
        """A cycle ran `plan` in `seconds`: its models with passes are the partners now."""
        passed = frozenset(w.model_id for w in plan.models if w.passes)
        self.models = passed if len(passed) > 1 else frozenset()
        if self.models:
            old = self.cycle_s
            self.cycle_s = seconds if old is None else DECAY * old + (1 - DECAY) * seconds

    def missing(self, queues: Mapping[str, Sequence[object]]) -> frozenset[str]:
        """Partners with nothing queued while another partner has work: worth a wait."""
        absent = frozenset(m for m in self.models if not queues.get(m))
        return absent if absent and absent != self.models else frozenset()

    def wait_s(self) -> float:
        return min(self.cycle_s or 0.0, MAX_WAIT_S)

    def gone(self, models: frozenset[str]) -> None:
        """They did not come in time: no more waits for them (until they share a cycle again)."""
        self.models -= models
