"""The demo's measurement plan and closing lines: the same steps each way, in turns, and a
summary that says what sharing gave (a saving, or plainly none), never a cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.demo.run import (
    Summary,
    TenantSummary,
    Way,
    base_model_bytes,
    blocks,
    what_sharing_gave,
)


@pytest.mark.parametrize("steps", [1, 2, 3, 12])
def test_both_ways_take_the_same_steps_in_turns(steps: int) -> None:
    plan = blocks(steps)
    for way in Way:
        assert sum(n for w, n in plan if w is way) == steps
    assert plan[0][0] is Way.TOGETHER
    assert [w for w, _ in plan] == [Way.TOGETHER, Way.ALONE, Way.ALONE, Way.TOGETHER][: len(plan)]


def _summary(together_s: float, alone_s: float) -> Summary:
    return Summary([], together_s, alone_s, 10, 8, 2.5, 24, 6, 2_000_000, alone_s / together_s)


def test_a_saving_is_reported_with_its_seconds_and_ratio() -> None:
    text = "\n".join(what_sharing_gave(_summary(6.0, 9.0)))
    assert "sharing saved 3.0 s (1.50x)" in text
    assert "together 10 (8 shared by 2+ tenants" in text and "one after another 24" in text


def test_no_saving_is_said_plainly_and_points_to_the_gpu_measurement() -> None:
    text = "\n".join(what_sharing_gave(_summary(9.0, 8.1)))
    assert "no time saved here (0.90x)" in text and "benchmarks/gpu_suite.py" in text
    assert "cost" not in text and "saved 0" not in text


def test_the_base_model_is_counted_once_for_all_tenants(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1_500_000)
    (tmp_path / "config.json").write_text("{}")
    assert base_model_bytes(tmp_path) == 1_500_000
    s = _summary(6.0, 9.0)
    s.tenants = [TenantSummary(f"t{i}", "SFT", 8, 5, 7.0, 2.0, 0.3, 0.2, "") for i in range(3)]
    s.base_model_bytes = base_model_bytes(tmp_path)
    text = "\n".join(what_sharing_gave(s))
    assert "one copy of the base model (1.5 MB of weights) for all 3 tenants'" in text
    assert "load it 3 times (4.5 MB)" in text
