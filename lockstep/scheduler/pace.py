"""How many pass tokens one clock cycle packs: the cycle-time target, in tokens.

Every tenant with work in a cycle waits for the whole cycle, so a cycle's length is the latency
floor of every light tenant beside a heavy one. `--token-budget` bounds a fused pass by memory
only (65536 tokens take seconds on a small accelerator); packed up to it, one tenant submitting
large batches as fast as it can makes every cycle that long. So the planner packs the tokens the
engine gets through in `--cycle-target` seconds, from the measured rate of recent cycles, never
more than `--token-budget`: the heavy tenant's excess waits for later cycles (it is owed its share,
deficit round robin in `planner`) while light tenants' requests go into every cycle.

Rate: an exponential average of pass tokens per second of dispatch over busy cycles. A cycle's
dispatch time is a fixed part (the optimizer step, snapshots, calls) plus a part per token, so a
small cycle under-states the rate; the budget then grows by (target / cycle seconds) per busy
cycle, converging where a cycle takes `target` seconds. Packing never changes a result (a tenant
alone == packed), only which cycle a request runs in.
"""

from __future__ import annotations

# Never plan fewer tokens than this per cycle: a short light-tenant step always fits, and the rate
# estimate cannot collapse on a few cycles dominated by fixed costs.
MIN_CYCLE_TOKENS = 512
SMOOTHING = 0.3  # weight of the newest busy cycle in the rate average


class CyclePace:
    def __init__(self, token_budget: int, target_s: float) -> None:
        self.token_budget = token_budget
        self.target_s = target_s
        self.rate: float | None = None  # pass tokens per second of dispatch, once measured

    def budget(self) -> int:
        """The pass tokens the next cycle packs."""
        if self.target_s <= 0 or self.rate is None:
            return self.token_budget
        tokens = int(self.rate * self.target_s)
        return max(min(tokens, self.token_budget), min(MIN_CYCLE_TOKENS, self.token_budget))

    def observe(self, tokens: int, seconds: float) -> None:
        """A cycle dispatched `tokens` pass tokens in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        self.rate = rate if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * rate
