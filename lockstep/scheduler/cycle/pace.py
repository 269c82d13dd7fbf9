"""How many pass tokens one clock cycle packs: the cycle-time target, in tokens.

Every tenant with work in a cycle waits for the whole cycle, so a cycle's length is the latency
floor of every light tenant beside a heavy one. `--token-budget` bounds a fused pass by memory
only (65536 tokens take seconds on a small accelerator); packed up to it, one tenant submitting
large batches as fast as it can makes every cycle that long. So the planner packs the tokens the
engine gets through in `--cycle-target` seconds, at the per-token cost measured over recent
cycles, never more than `--token-budget`: the heavy tenant's excess waits for later cycles (it
is owed its share, deficit round robin in `planner`) while light tenants' requests go into every
cycle. Only while tenants share the clock: a model alone fills `--token-budget` as before.

Rate: a cycle's dispatch time is a fixed part (optimizer steps, snapshots, calls) plus a part
per pass token. The fixed part is paid by every cycle whatever the budget, so only the part per
token is budgeted: a least-squares line through recent cycles (sizes differ: light-only cycles
are small, packed ones large) gives the seconds per token, and a cycle packs `target / that`
tokens. Until two cycles of different sizes were seen the clock packs up to `--token-budget`.
Packing never changes a result (a tenant alone == packed), only which cycle a request runs in.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

# Never plan fewer tokens than this per cycle: a short light-tenant step always fits.
MIN_CYCLE_TOKENS = 512
# Tenants share the clock while more than one model had passes queued within the last few cycles
# and seconds: a pipelined light tenant is between two steps in some cycles, and a heavy tenant
# alone in those must not fill them. A model really alone packs up to --token-budget.
SHARE_CYCLES = 4
SHARE_WINDOW_S = 2.0
DECAY = 0.95  # weight of older cycles in the fit (about the last 20 count)
SPREAD = 0.1  # sizes must vary by this much (std / mean) to tell per-token from fixed cost


class CyclePace:
    def __init__(self, token_budget: int, target_s: float) -> None:
        self.token_budget = token_budget
        self.target_s = target_s
        self.seconds_per_token: float | None = None  # once measured
        self._sums = [0.0] * 5  # decayed: weight, tokens, seconds, tokens^2, tokens*seconds
        self._cycle = 0
        self._seen: dict[str, tuple[int, float]] = {}  # model -> (cycle, time) it had passes

    def budget(self, with_passes: Iterable[str]) -> int:
        """The pass tokens the next cycle packs; `with_passes`: the models with passes queued."""
        self._cycle += 1
        now = time.monotonic()
        self._seen.update((m, (self._cycle, now)) for m in with_passes)
        self._seen = {
            m: (c, t)
            for m, (c, t) in self._seen.items()
            if self._cycle - c < SHARE_CYCLES and now - t < SHARE_WINDOW_S
        }
        if len(self._seen) <= 1 or self.target_s <= 0 or self.seconds_per_token is None:
            return self.token_budget
        tokens = int(self.target_s / self.seconds_per_token)
        return max(min(tokens, self.token_budget), min(MIN_CYCLE_TOKENS, self.token_budget))

    def observe(self, tokens: int, seconds: float) -> None:
        """A cycle dispatched `tokens` pass tokens in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        new = (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        self._sums = [DECAY * old + x for old, x in zip(self._sums, new, strict=True)]
        w, t, s, tt, ts = self._sums
        mean_t, mean_s = t / w, s / w
        var = tt / w - mean_t**2
        cov = ts / w - mean_t * mean_s
        if var > (SPREAD * mean_t) ** 2 and cov > 0:
            self.seconds_per_token = cov / var
