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
tokens. Until cycles of different sizes were seen, the cost per token is bounded by the mean
seconds per token of the cycles seen (fixed costs included, so the pace is smaller than the
fit's), and before any cycle was seen tenants sharing the clock pack `MIN_CYCLE_TOKENS` each: a
heavy tenant arriving first never gets a whole `--token-budget` cycle beside light ones.
Packing never changes a result (a tenant alone == packed), only which cycle a request runs in.

Who shares the clock: a model counts from the cycle it has passes queued until it misses its
own cadence. Its period is the mean time between the cycles it had passes queued in (a
pipelined model: about one cycle; a client that reads each result before its next step: its
step time), and it counts until `SHARE_PERIODS` of its periods passed without passes (a model
seen once: for `SHARE_CYCLES` cycles). That is measured against the model's own behaviour, not a
fixed number of seconds: a busy machine that stretches a light tenant's steps stretches its
window with them, so the heavy tenant beside it keeps the pace; and a tenant that stopped leaves
after a few of its periods, however long the clock was idle since.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

# Never plan fewer tokens than this per cycle: a short light-tenant step always fits.
MIN_CYCLE_TOKENS = 512
# Tenants share the clock while more than one model is within its sharing window (module
# docstring): a light tenant is between two steps in some cycles, and a heavy tenant alone in
# those must not fill them. A model really alone packs up to --token-budget.
SHARE_PERIODS = 3.0  # a model's own periods since it last had passes queued
SHARE_CYCLES = 4  # cycles, for a model seen once (no period yet)
PERIOD_DECAY = 0.8  # weight of the older gaps in a model's period
MAX_KNOWN = 100_000  # models whose cadence is remembered
DECAY = 0.95  # weight of older cycles in the fit (about the last 20 count)
SPREAD = 0.1  # sizes must vary by this much (std / mean) to tell per-token from fixed cost


@dataclass
class _Seen:
    """When a model last had passes queued, and its cadence."""

    cycle: int
    at: float  # time.monotonic()
    period: float | None = None  # mean time between its cycles with passes (None: seen once)

    def returns(self, cycle: int, now: float) -> None:
        gap = now - self.at
        self.period = (
            gap if self.period is None else PERIOD_DECAY * self.period + (1 - PERIOD_DECAY) * gap
        )
        self.cycle, self.at = cycle, now

    def shares(self, cycle: int, now: float) -> bool:
        if self.period is None:
            return cycle - self.cycle < SHARE_CYCLES
        return now - self.at < SHARE_PERIODS * self.period


class CyclePace:
    def __init__(self, token_budget: int, target_s: float) -> None:
        self.token_budget = token_budget
        self.target_s = target_s
        self.seconds_per_token: float | None = None  # once measured
        self._sums = [0.0] * 5  # decayed: weight, tokens, seconds, tokens^2, tokens*seconds
        self._cycle = 0
        # Every model that had passes queued and its cadence (the oldest go past MAX_KNOWN).
        self._seen: dict[str, _Seen] = {}

    def budget(self, with_passes: Iterable[str]) -> int:
        """The pass tokens the next cycle packs; `with_passes`: the models with passes queued."""
        self._cycle += 1
        now = time.monotonic()
        for m in with_passes:
            seen = self._seen.pop(m, None)  # re-inserted last: the dict is in recency order
            if seen is None:
                seen = _Seen(self._cycle, now)
            else:
                seen.returns(self._cycle, now)
            self._seen[m] = seen
        while len(self._seen) > MAX_KNOWN:
            del self._seen[next(iter(self._seen))]
        sharing = sum(s.shares(self._cycle, now) for s in self._seen.values())
        if sharing <= 1 or self.target_s <= 0:
            return self.token_budget
        floor = min(MIN_CYCLE_TOKENS, self.token_budget)
        per_token = self.seconds_per_token
        if per_token is None:  # not fitted yet: an upper bound, fixed costs included
            w, t, s, _, _ = self._sums
            if t <= 0:
                return floor
            per_token = s / t
        return max(min(int(self.target_s / per_token), self.token_budget), floor)

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
