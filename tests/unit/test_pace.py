"""CyclePace: the cycle-time target in tokens, from the measured engine rate (pure)."""

from __future__ import annotations

import pytest

from lockstep.scheduler.cycle import pace as pace_module
from lockstep.scheduler.cycle.pace import MIN_CYCLE_TOKENS, SHARE_CYCLES, CyclePace

SHARED = ("light", "heavy")  # models with passes queued: tenants share the clock


def engine(tokens: int) -> float:
    """A cycle's dispatch seconds: 30 ms fixed (optimizer steps, calls) + 50 us per token."""
    return 0.03 + 50e-6 * tokens


def test_before_cycles_of_different_sizes_the_budget_stays_small() -> None:
    """A heavy tenant arriving first never gets a whole --token-budget cycle beside a light one:
    before any cycle the pace is the floor, then the mean cost per token (fixed costs in) bounds
    it until the fit knows the per-token part."""
    pace = CyclePace(65536, 0.05)
    assert pace.budget(SHARED) == MIN_CYCLE_TOKENS
    for _ in range(5):
        pace.observe(4096, engine(4096))  # one size only: the per-token part is unknown
    assert pace.seconds_per_token is None
    mean = engine(4096) / 4096
    assert abs(pace.budget(SHARED) - int(0.05 / mean)) <= 1  # below the fit's 1000


def test_the_budget_is_the_tokens_the_target_buys_beyond_fixed_costs() -> None:
    pace = CyclePace(65536, 0.05)
    for i in range(40):
        tokens = 192 if i % 2 else 8192  # light-only cycles and packed ones
        pace.observe(tokens, engine(tokens))
    assert abs(pace.budget(SHARED) - 1000) <= 2  # 50 ms / 50 us


def test_the_budget_stays_within_its_bounds() -> None:
    fast = CyclePace(4096, 0.05)
    slow = CyclePace(65536, 0.05)
    for tokens in (100, 10_000, 100, 10_000):
        fast.observe(tokens, 1e-9 * tokens + 0.01)
        slow.observe(tokens, 1e-3 * tokens)
    assert fast.budget(SHARED) == 4096  # never above the memory bound
    assert slow.budget(SHARED) == MIN_CYCLE_TOKENS  # a light step always fits


def test_zero_target_packs_the_whole_budget() -> None:
    pace = CyclePace(65536, 0.0)
    for tokens in (100, 10_000):
        pace.observe(tokens, engine(tokens))
    assert pace.budget(SHARED) == 65536


def test_a_model_alone_packs_the_whole_budget_and_recent_neighbours_count() -> None:
    pace = CyclePace(65536, 0.05)
    for i in range(40):
        tokens = 192 if i % 2 else 8192
        pace.observe(tokens, engine(tokens))
    assert pace.budget(["heavy"]) == 65536  # alone
    assert pace.budget(["heavy", "light"]) < 2000
    # The light tenant is between two steps: the heavy one still shares the clock with it...
    assert pace.budget(["heavy"]) < 2000
    for _ in range(SHARE_CYCLES):  # ...until it has had no passes for a few cycles
        budget = pace.budget(["heavy"])
    assert budget == 65536


@pytest.mark.parametrize("slowdown", [1.0, 10.0])
def test_a_tenant_between_steps_shares_the_clock_by_its_own_cadence(
    monkeypatch: pytest.MonkeyPatch, slowdown: float
) -> None:
    """A light tenant reads each result before its next step; a heavy one runs back to back.
    The light one keeps the heavy one at the pace for a few of its own periods after each step,
    however long the machine makes them (`slowdown`), and not for ever after it stopped."""
    now = [0.0]
    monkeypatch.setattr(pace_module.time, "monotonic", lambda: now[0])
    pace = CyclePace(65536, 0.05)
    for i in range(40):
        tokens = 192 if i % 2 else 8192
        pace.observe(tokens, engine(tokens))

    def cycles(seconds: float, light: bool = False) -> list[int]:
        """Heavy cycles every 0.1 s (slowed down) for `seconds`; the light tenant in the first."""
        out = []
        for k in range(int(seconds / 0.1)):
            now[0] += 0.1 * slowdown
            out.append(pace.budget(["heavy", "light"] if light and k == 0 else ["heavy"]))
        return out

    cycles(1.0, light=True)  # its first step: no period yet (SHARE_CYCLES cycles only)
    for _ in range(4):  # then a step every second (slowed down): its period
        assert max(cycles(1.0, light=True)) < 2000
    assert max(cycles(1.5)) < 2000  # 2.5 periods since its last step: 25 cycles, still sharing
    assert cycles(1.0)[-1] == 65536  # it stopped: after SHARE_PERIODS periods, heavy is alone
