"""The planner is pure: these tests feed it queues and read the CyclePlan, no I/O."""

from __future__ import annotations

from lockstep.scheduler.planner import CyclePlan, Datums, plan_cycle
from lockstep.scheduler.state.records import QueuedOp


def op(model: str, seq: int, kind: str, tokens: int = 0) -> QueuedOp:
    return QueuedOp(f"{model}-{seq}", model, seq, kind, tokens)


def kinds(ops: list[QueuedOp]) -> list[tuple[str, int]]:
    return [(o.model_id, o.seq_id) for o in ops]


def test_quickstart_step_runs_in_one_cycle() -> None:
    queues = {
        "m": [op("m", 1, "forward_backward", 10), op("m", 2, "optim_step"), op("m", 3, "save")]
    }
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1)]
    assert kinds(plan.optims) == [("m", 2)]
    assert kinds(plan.post) == [("m", 3)]


def test_optim_step_is_a_barrier_for_its_own_model_only() -> None:
    queues = {
        "a": [
            op("a", 1, "forward_backward", 5),
            op("a", 2, "optim_step"),
            op("a", 3, "forward_backward", 5),
        ],
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
    queues = {
        "m": [
            op("m", 0, "create_model"),
            op("m", 1, "forward_backward", 3),
            op("m", 2, "load"),
            op("m", 3, "forward_backward", 3),
        ]
    }
    plan = plan_cycle(queues, {"m": 0}, token_budget=100)
    assert kinds(plan.pre) == [("m", 0)]
    assert kinds(plan.passes) == [("m", 1)]
    assert plan.optims == [] and plan.post == []


def test_save_before_passes_runs_in_pre_phase() -> None:
    queues = {
        "m": [
            op("m", 1, "save"),
            op("m", 2, "forward_backward", 3),
            op("m", 3, "optim_step"),
            op("m", 4, "save"),
        ]
    }
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.pre) == [("m", 1)]
    assert kinds(plan.post) == [("m", 4)]


def test_pass_after_a_post_save_waits() -> None:
    queues = {
        "m": [
            op("m", 1, "forward_backward", 3),
            op("m", 2, "save"),
            op("m", 3, "forward_backward", 3),
        ]
    }
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1)] and kinds(plan.post) == [("m", 2)]


def test_token_budget_defers_work_and_the_deferred_model_is_owed_the_next_cycle() -> None:
    queues = {"a": [op("a", 1, "forward_backward", 80)], "b": [op("b", 1, "forward_backward", 30)]}
    first = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    assert kinds(first.passes) == [("b", 1)]  # a's 80 exceeds its fair share (50) this cycle
    assert first.deficits == {"a": 50}
    queues["b"] = [op("b", 2, "forward_backward", 30)]
    second = plan_cycle(queues, {"a": 1, "b": 2}, token_budget=100, deficits=first.deficits)
    assert kinds(second.passes) == [("a", 1)]  # a is owed the most, pays 80 of its 100
    assert second.deficits == {"b": 50}


def test_an_oversized_lone_request_still_runs() -> None:
    huge = {"a": [op("a", 1, "forward_backward", 500)]}
    assert kinds(plan_cycle(huge, {"a": 1}, token_budget=100).passes) == [("a", 1)]


def test_a_huge_backlog_cannot_starve_a_small_tenant() -> None:
    big = [op("big", s, "forward_backward", 60) for s in range(1, 41)]
    owed: dict[str, int] = {}
    next_seq = {"big": 1, "small": 1}
    for cycle in range(10):
        queues = {"big": big, "small": [op("small", cycle + 1, "forward_backward", 10)]}
        plan = plan_cycle(queues, next_seq, token_budget=100, deficits=owed)
        assert ("small", cycle + 1) in kinds(plan.passes)
        assert plan.tokens <= 100
        ran_big = [o for o in plan.passes if o.model_id == "big"]
        assert ran_big, "the big tenant also progresses"
        next_seq = {"big": ran_big[-1].seq_id + 1, "small": cycle + 2}
        owed = plan.deficits


def test_chunks_of_one_call_are_admitted_together() -> None:
    queues = {
        "a": [op("a", s, "forward_backward", 30) for s in (1, 2, 3)],
        "b": [op("b", 1, "forward_backward", 40)],
    }
    first = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    # a's three chunks (90 tokens) form one unit: never split across cycles
    assert [o.seq_id for o in first.passes if o.model_id == "a"] == []
    queues["b"] = []
    second = plan_cycle(queues, {"a": 1, "b": 2}, token_budget=100, deficits=first.deficits)
    assert [o.seq_id for o in second.passes if o.model_id == "a"] == [1, 2, 3]


def test_a_deferred_pass_holds_back_everything_after_it() -> None:
    queues = {
        "a": [
            op("a", 1, "forward", 10),
            op("a", 2, "rejected"),
            op("a", 3, "forward_backward", 500),
            op("a", 4, "optim_step"),
            op("a", 5, "save"),
        ],
        "b": [op("b", 1, "forward_backward", 10)],
    }
    plan = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    work_a = next(w for w in plan.models if w.model_id == "a")
    assert [o.seq_id for o in work_a.ops()] == [1, 2]  # 3 did not fit: 4 and 5 wait with it


def test_plan_totals() -> None:
    queues = {
        "a": [op("a", 1, "forward_backward", 7), op("a", 2, "optim_step")],
        "b": [op("b", 1, "forward", 5)],
    }
    plan = plan_cycle(queues, {"a": 1, "b": 1}, token_budget=100)
    assert plan.tokens == 12 and len(plan.models) == 2 and not plan.empty


def test_a_rejected_request_holds_its_seq_without_changing_the_phase() -> None:
    queues = {
        "m": [
            op("m", 1, "forward_backward", 3),
            op("m", 2, "rejected"),
            op("m", 3, "forward_backward", 3),
            op("m", 4, "optim_step"),
        ]
    }
    plan = plan_cycle(queues, {"m": 1}, token_budget=100)
    assert kinds(plan.passes) == [("m", 1), ("m", 3)]
    assert kinds(plan.optims) == [("m", 4)]
    assert kinds(plan.models[0].rejected) == [("m", 2)]


# ---------------------------------------------------------------- the per-key tokens-per-cycle cap
def key_tokens(plan_passes: list[QueuedOp], owners: dict[str, str], key: str) -> int:
    return sum(o.tokens for o in plan_passes if owners[o.model_id] == key)


def test_the_key_cap_bounds_one_keys_tokens_and_the_rest_waits() -> None:
    owners = {"a": "k1", "b": "k1", "c": "k2"}
    queues = {
        "a": [op("a", 1, "forward_backward", 60)],
        "b": [op("b", 1, "forward_backward", 60)],
        "c": [op("c", 1, "forward_backward", 60)],
    }
    plan = plan_cycle(queues, {"a": 1, "b": 1, "c": 1}, 1000, owners=owners, key_cap=100)
    assert key_tokens(plan.passes, owners, "k1") == 60  # a and b together would be 120 > 100
    assert kinds(plan.passes) == [("a", 1), ("c", 1)]
    assert set(plan.deficits) == {"b"}  # b waits, owed, and is no error
    # without the cap all three fit the budget: the cap alone held b back
    assert len(plan_cycle(queues, {"a": 1, "b": 1, "c": 1}, 1000).passes) == 3


def test_the_key_cap_leaves_other_keys_alone() -> None:
    owners = {"a": "k1", "c": "k2"}
    queues = {
        "a": [op("a", s, "forward", 40) for s in range(1, 6)],
        "c": [op("c", 1, "forward_backward", 300), op("c", 2, "optim_step")],
    }
    plan = plan_cycle(queues, {"a": 1, "c": 1}, 1000, owners=owners, key_cap=100)
    assert key_tokens(plan.passes, owners, "k1") <= 100
    assert kinds(plan.passes)[-1] == ("c", 1) and kinds(plan.optims) == [("c", 2)]
    # k2 gets the same as with no cap at all
    free = plan_cycle(queues, {"a": 1, "c": 1}, 1000)
    assert [o for o in free.passes if o.model_id == "c"] == [
        o for o in plan.passes if o.model_id == "c"
    ]


def test_a_request_larger_than_the_key_cap_runs_alone_for_its_key() -> None:
    owners = {"a": "k1", "b": "k1", "c": "k2"}
    queues = {
        "a": [op("a", 1, "forward_backward", 500)],
        "b": [op("b", 1, "forward_backward", 10)],
        "c": [op("c", 1, "forward_backward", 10)],
    }
    owed: dict[str, int] = {}
    seen: list[set[str]] = []
    next_seq = {"a": 1, "b": 1, "c": 1}
    for _ in range(3):
        plan = plan_cycle(queues, next_seq, 1000, owed, owners=owners, key_cap=100)
        ran = {o.model_id for o in plan.passes}
        seen.append(ran)
        assert not {"a", "b"} <= ran  # the oversize request never shares its key's cycle
        assert "c" in ran or next_seq["c"] == 2  # the other key is never held back
        for m in ran:
            queues[m] = []
            next_seq[m] = 2
        owed = plan.deficits
    assert set().union(*seen) == {"a", "b", "c"}  # everyone ran: nothing starves


def test_models_of_one_capped_key_take_turns() -> None:
    owners = {"a": "k", "b": "k"}
    next_seq = {"a": 1, "b": 1}
    owed: dict[str, int] = {}
    ran: dict[str, int] = {"a": 0, "b": 0}
    for _ in range(10):
        queues = {m: [op(m, next_seq[m], "forward_backward", 60)] for m in ("a", "b")}
        plan = plan_cycle(queues, next_seq, 1000, owed, owners=owners, key_cap=100)
        assert plan.tokens <= 100 and len(plan.passes) == 1
        (done,) = plan.passes
        ran[done.model_id] += 1
        next_seq[done.model_id] += 1
        owed = plan.deficits
    assert ran == {"a": 5, "b": 5}


def test_a_models_ops_come_out_in_seq_order_with_rejections_between() -> None:
    """Commit order is ops() order: a rejected request between passes must not come last, or
    the model's progress would be written backwards (the pipelined-after-a-400 hang)."""
    ops = [
        op("a", 1, "rejected", 0),
        op("a", 2, "forward_backward"),
        op("a", 3, "optim_step"),
        op("a", 4, "rejected", 0),
        op("a", 5, "save", 0),
    ]
    (work,) = plan_cycle({"a": ops}, {"a": 1}, 1000).models
    assert [o.seq_id for o in work.ops()] == [1, 2, 3, 4, 5]


def light_and_heavy(heavy_tokens: int, n_light: int = 3) -> dict[str, list[QueuedOp]]:
    queues = {
        f"light{i}": [op(f"light{i}", 1, "forward_backward", 64), op(f"light{i}", 2, "optim_step")]
        for i in range(n_light)
    }
    queues["heavy"] = [
        op("heavy", 1, "forward_backward", heavy_tokens),
        op("heavy", 2, "optim_step"),
    ]
    return queues


def test_a_heavy_tenant_beside_light_ones_fills_only_the_budget() -> None:
    """Light tenants' steps go into every cycle; the heavy one's excess waits (noisy neighbour)."""
    queues = light_and_heavy(heavy_tokens=0)
    queues["heavy"] = [op("heavy", s, "forward_backward", 300) for s in range(1, 9)]
    plan = plan_cycle(queues, dict.fromkeys(queues, 1), token_budget=1000)
    assert {w.model_id for w in plan.models} >= {"light0", "light1", "light2"}
    assert all(w.optim is not None for w in plan.models if w.model_id.startswith("light"))
    assert plan.tokens <= 1000
    assert "heavy" in plan.deficits


def test_an_op_bigger_than_the_budget_waits_until_its_model_saved_for_it() -> None:
    """Each cycle the light tenants run; the unused room pays towards the heavy op, which then
    runs in one overlong cycle beside them: never starved, never blocking them."""
    owed: dict[str, int] = {}
    cycles = 0
    while True:
        cycles += 1
        queues = light_and_heavy(heavy_tokens=4000)
        plan = plan_cycle(queues, dict.fromkeys(queues, 1), 1000, owed)
        assert {f"light{i}" for i in range(3)} <= {w.model_id for w in plan.models}
        owed = plan.deficits
        if any(w.model_id == "heavy" for w in plan.models):
            break
        assert cycles < 10
    assert 2 <= cycles <= 6
    heavy = next(w for w in plan.models if w.model_id == "heavy")
    assert heavy.tokens == 4000 and heavy.optim is not None
    assert "heavy" not in plan.deficits


def test_a_run_of_calls_bigger_than_the_cycle_spreads_over_cycles() -> None:
    """The clock's pace (cycle_tokens) is below the heavy tenant's gradient-accumulation run,
    the memory bound (token_budget) is not: the run goes call by call, beside the light ones."""
    owed: dict[str, int] = {}
    heavy = [op("heavy", s, "forward_backward", 300) for s in range(1, 9)]
    ran: list[int] = []
    for _ in range(10):
        queues = light_and_heavy(heavy_tokens=0)
        queues["heavy"] = heavy
        nxt = dict.fromkeys(queues, 1)
        nxt["heavy"] = 1 + sum(ran)
        plan = plan_cycle(queues, nxt, 65536, owed, cycle_tokens=1000)
        assert {f"light{i}" for i in range(3)} <= {w.model_id for w in plan.models}
        # The heavy model packs at most the pace; the light ones' steps go in beside it.
        assert sum(w.tokens for w in plan.models if w.model_id == "heavy") <= 1000
        owed = plan.deficits
        ran.append(sum(len(w.passes) for w in plan.models if w.model_id == "heavy"))
        if sum(ran) == len(heavy):
            return
    raise AssertionError(f"the heavy run did not finish: {ran}")


def test_tenants_of_like_size_pack_whole_under_the_pace() -> None:
    """Eight tenants each sending 256 tokens share a cycle whose pace is 500 tokens: none is
    bigger than its neighbours, so all go in ONE cycle (the pace bounds the heavy, not the many)."""
    queues = {f"t{i}": [op(f"t{i}", 1, "forward_backward", 256)] for i in range(8)}
    plan = plan_cycle(queues, dict.fromkeys(queues, 1), 65536, {}, cycle_tokens=500)
    assert plan.tokens == 8 * 256 and not plan.deficits


# -- requests larger than the pace run in parts ------------------------------------------------


def run_in_parts(
    queues: dict[str, list[QueuedOp]], sizes: dict[str, tuple[int, ...]], cycle_tokens: int
) -> list[CyclePlan]:
    """Plan cycles until every queue is done, as the clock does: each cycle's parts move their
    requests on (`Datums.done`), committed ops leave their queues."""
    next_seq = {m: ops[0].seq_id for m, ops in queues.items()}
    done: dict[str, int] = {}
    owed: dict[str, int] = {}
    plans: list[CyclePlan] = []
    while any(queues.values()):
        datums = {rid: Datums(t, done.get(rid, 0)) for rid, t in sizes.items()}
        plan = plan_cycle(queues, next_seq, 65536, owed, cycle_tokens=cycle_tokens, datums=datums)
        plans.append(plan)
        owed = plan.deficits
        for rid, part in plan.parts.items():
            done[rid] = part.stop
        for work in plan.models:
            ran = {o.request_id for o in work.ops()}
            queues[work.model_id] = [o for o in queues[work.model_id] if o.request_id not in ran]
            if ran:
                next_seq[work.model_id] = max(o.seq_id for o in work.ops()) + 1
        assert len(plans) < 500
    return plans


def test_a_request_larger_than_the_pace_runs_in_parts_beside_the_light_tenants() -> None:
    heavy = tuple([384] * 100)  # ~100x a pace of ~400 tokens
    queues = light_and_heavy(sum(heavy))
    plans = run_in_parts(queues, {"heavy-1": heavy}, cycle_tokens=400)
    first = plans[0]
    # The light tenants' steps all run in the first cycle, beside the heavy request's first part.
    assert {f"light{i}" for i in range(3)} <= {w.model_id for w in first.models}
    assert all(w.optim is not None for w in first.models if w.model_id.startswith("light"))
    parts = [p.parts["heavy-1"] for p in plans if "heavy-1" in p.parts]
    assert len(parts) > 10 and parts[0].start == 0 and parts[-1].final
    assert all(a.stop == b.start for a, b in zip(parts, parts[1:], strict=False))  # in order
    for plan in plans:
        (heavy_work,) = [w for w in plan.models if w.model_id == "heavy"] or [None]
        if heavy_work is None:
            continue
        assert heavy_work.tokens <= 400 + 64 * 3  # at most the pace (and the room nobody used)
        part = plan.parts["heavy-1"]
        if part.final:  # committed with its last part; its optim_step may follow in that cycle
            assert [o.seq_id for o in heavy_work.ops()] == [1, 2]
        else:  # nothing of the model commits, nothing of it runs after the part
            assert heavy_work.open == "heavy-1" and heavy_work.ops() == []
            assert heavy_work.optim is None and "heavy" in plan.deficits


def test_a_tenant_alone_never_splits() -> None:
    heavy = tuple([384] * 100)
    queues = light_and_heavy(sum(heavy), n_light=0)
    sizes = {"heavy-1": heavy}
    (plan,) = run_in_parts(queues, sizes, cycle_tokens=65536)  # the pace of a model alone
    assert not plan.parts and [o.seq_id for o in plan.models[0].ops()] == [1, 2]


def test_a_part_starts_its_models_passes_and_ends_them() -> None:
    """A request in parts never shares a fused pass with its model's other requests: it waits
    for a cycle of its own, and the model's next pass waits for the cycle after its last part."""
    big = tuple([300] * 4)
    queues = light_and_heavy(0)
    queues["heavy"] = [
        op("heavy", 1, "forward_backward", 50),
        op("heavy", 2, "forward_backward", sum(big)),
        op("heavy", 3, "forward_backward", 50),
    ]
    plans = run_in_parts(queues, {"heavy-2": big}, cycle_tokens=400)
    heavy = [[o.seq_id for o in w.passes] for p in plans for w in p.models if w.model_id == "heavy"]
    assert heavy[0] == [1]
    assert heavy[-1] == [3] and all(seqs == [2] for seqs in heavy[1:-1])
    parts = [p.parts["heavy-2"] for p in plans if "heavy-2" in p.parts]
    assert sum(p.stop - p.start for p in parts) == 4 and parts[-1].final


def test_a_datum_longer_than_the_pace_is_one_part() -> None:
    sizes = (100, 5000, 100)
    queues = light_and_heavy(sum(sizes))
    plans = run_in_parts(queues, {"heavy-1": sizes}, cycle_tokens=400)
    parts = [p.parts["heavy-1"] for p in plans if "heavy-1" in p.parts]
    assert any(p.start == 1 and p.stop == 2 for p in parts), parts  # the long datum alone
    assert parts[-1].final and sum(p.stop - p.start for p in parts) == 3


def test_a_failed_open_part_is_committed_with_its_error() -> None:
    queues = light_and_heavy(38400)
    datums = {"heavy-1": Datums(tuple([384] * 100))}
    plan = plan_cycle(queues, dict.fromkeys(queues, 1), 65536, cycle_tokens=400, datums=datums)
    (heavy,) = [w for w in plan.models if w.model_id == "heavy"]
    assert heavy.ops() == []
    (settled,) = [w for w in plan.settled({"heavy-1": "its error"}).models if w.model_id == "heavy"]
    assert [o.request_id for o in settled.ops()] == ["heavy-1"]
