"""CyclePace: the cycle-time target in tokens, from the measured engine rate (pure)."""

from __future__ import annotations

from lockstep.scheduler.pace import MIN_CYCLE_TOKENS, CyclePace


def test_before_any_cycle_the_budget_is_the_token_budget() -> None:
    assert CyclePace(65536, 0.05).budget() == 65536


def test_the_budget_is_what_the_engine_does_in_the_target_time() -> None:
    pace = CyclePace(65536, 0.05)
    for _ in range(50):
        pace.observe(20_000, 1.0)  # 20k tokens/s
    assert pace.budget() == 1000


def test_the_budget_stays_within_its_bounds() -> None:
    pace = CyclePace(4096, 0.05)
    pace.observe(10_000_000, 1.0)
    assert pace.budget() == 4096  # never above the memory bound
    slow = CyclePace(65536, 0.05)
    slow.observe(10, 1.0)
    assert slow.budget() == MIN_CYCLE_TOKENS  # a light step always fits


def test_fixed_costs_per_cycle_converge_to_the_target() -> None:
    """dispatch = 20 ms fixed + 50 us per token: the budget grows until a cycle takes 50 ms."""
    pace = CyclePace(65536, 0.05)
    tokens = MIN_CYCLE_TOKENS
    for _ in range(60):
        pace.observe(tokens, 0.02 + 50e-6 * tokens)
        tokens = pace.budget()
    assert abs((0.02 + 50e-6 * tokens) - 0.05) < 0.005


def test_zero_target_packs_the_whole_budget() -> None:
    pace = CyclePace(65536, 0.0)
    pace.observe(1000, 1.0)
    assert pace.budget() == 65536
