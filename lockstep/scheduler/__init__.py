"""The scheduler process, one folder per role (docs/ARCHITECTURE.md, "Module map"):

    api/        the gRPC services             admission/  validate and enqueue once
    cycle/      the clock, dispatch, lanes    observers/  metrics, traces, accounting
    state/      Redis, disk, residency        ops/        one module per op kind

`server` wires them around the engines; `__main__` picks the engines. Two shared modules stay
here because roles on different levels read them: `planner` (the `CyclePlan` the cycle runs
and the observers watch) and `translate` (wire <-> engine types, for ops, admission and the
sampling lane). Imports go downward only: api -> admission / cycle -> observers -> planner ->
ops -> state (checked by import-linter's acyclic-siblings contract).
"""
