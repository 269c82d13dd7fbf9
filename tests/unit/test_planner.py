"""The planner is pure: these tests feed it queues and read the CyclePlan, no I/O."""

from __future__ import annotations

from lockstep.scheduler.planner import plan_cycle
from lockstep.scheduler.records import QueuedOp


def op(model: str, seq: int, kind: str, tokens: int = 0) -> QueuedOp:
    return QueuedOp(f"{model}-{seq}", model, seq, kind, tokens)


def kinds(ops: list[QueuedOp]) -> list[tuple[str, int]]:
    return [(o.model_id, o.seq_id) for o in ops]


def test_quickstart_step_runs_in_one_cycle() -> None:
    queues = {"m": [op("m", 1, "forward_backward", 10), op("m", 2, "optim_step"),
                    op("m", 3, "save")]}
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1)]
    assert kinds(plan.optims) == [("m", 2)]
    assert kinds(plan.post) == [("m", 3)]


def test_optim_step_is_a_barrier_for_its_own_model_only() -> None:
    queues = {
        "a": [op("a", 1, "forward_backward", 5), op("a", 2, "optim_step"),
              op("a", 3, "forward_backward", 5)],
        "b": [op("b", 1, "forward_backward", 5), op("b", 2, "forward_backward", 5)],
    }
    plan = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    assert kinds(plan.passes) == [("a", 1), ("b", 1), ("b", 2)]
    assert kinds(plan.optims) == [("a", 2)]  # a's seq 3 must see the stepped weights: next cycle


def test_requests_run_in_seq_order_and_wait_for_gaps() -> None:
    # chunk seq 3 and 2 arrived before seq 1 (the SDK sends the lowest chunk last)
    queues = {"m": [op("m", 3, "forward_backward", 1), op("m", 2, "forward_backward", 1)]}
    assert plan_cycle(queues, {"m": 1}, token_budget=100).empty
    queues["m"].append(op("m", 1, "forward_backward", 1))
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1), ("m", 2), ("m", 3)]


def test_already_executed_entries_are_skipped() -> None:
    queues = {"m": [op("m", 1, "forward_backward", 1), op("m", 2, "optim_step")]}
    plan = plan_cycle(queues, {"m": 2}, token_budget=100)
    assert plan.passes == [] and kinds(plan.optims) == [("m", 2)]


def test_create_and_load_run_before_the_pass_and_load_is_a_barrier() -> None:
    queues = {"m": [op("m", 0, "create_model"), op("m", 1, "forward_backward", 3),
                    op("m", 2, "load"), op("m", 3, "forward_backward", 3)]}
    plan = plan_cycle(queues, {"m": 0}, token_budget=100)
    assert kinds(plan.pre) == [("m", 0)]
    assert kinds(plan.passes) == [("m", 1)]
    assert plan.optims == [] and plan.post == []


def test_save_before_passes_runs_in_pre_phase() -> None:
    queues = {"m": [op("m", 1, "save"), op("m", 2, "forward_backward", 3),
                    op("m", 3, "optim_step"), op("m", 4, "save")]}
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.pre) == [("m", 1)]
    assert kinds(plan.post) == [("m", 4)]


def test_pass_after_a_post_save_waits() -> None:
    queues = {"m": [op("m", 1, "forward_backward", 3), op("m", 2, "save"),
                    op("m", 3, "forward_backward", 3)]}
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1)] and kinds(plan.post) == [("m", 2)]


def test_token_budget_defers_work_but_an_oversized_lone_request_still_runs() -> None:
    queues = {"a": [op("a", 1, "forward_backward", 80)], "b": [op("b", 1, "forward_backward", 30)]}
    plan = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    assert kinds(plan.passes) == [("a", 1)]
    huge = {"a": [op("a", 1, "forward_backward", 500)]}
    assert kinds(plan_cycle(huge, {"a": 1}, token_budget=100).passes) == [("a", 1)]


def test_plan_totals() -> None:
    queues = {"a": [op("a", 1, "forward_backward", 7), op("a", 2, "optim_step")],
              "b": [op("b", 1, "forward", 5)]}
    plan = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    assert plan.tokens == 12 and len(plan.models) == 2 and not plan.empty


def test_a_rejected_request_holds_its_seq_without_changing_the_phase() -> None:
    queues = {"m": [op("m", 1, "forward_backward", 3), op("m", 2, "rejected"),
                    op("m", 3, "forward_backward", 3), op("m", 4, "optim_step")]}
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1), ("m", 3)]
    assert kinds(plan.optims) == [("m", 4)]
    assert kinds(plan.models[0].rejected) == [("m", 2)]
