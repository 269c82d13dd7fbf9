"""What each console page shows, read through the API's own route functions (the same calls,
scope and ownership rules an SDK client gets; nothing here reads the scheduler another way)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from lockstep.gateway.console import chart
from lockstep.gateway.console.chart import BarChart, LineChart, bar_chart, line_chart
from lockstep.gateway.console.clock import ClockWatch
from lockstep.gateway.deps import Caller, Scope, read_scope
from lockstep.gateway.routes import accounting, runs
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.stub import TimedStub

# What a view hands its template (Jinja reads it by name).
Page = dict[str, object]

RUNS_PER_PAGE = 100
CHARTS_PER_RUN = 3  # the first metrics of a run drawn (losses first); the rest are listed
USAGE_DAYS = 14


async def scope_of(caller: Caller) -> Scope:
    """The console reads as the SDK's `access_scope=accessible`: an admin key every key's
    runs, any other key its own (deps.read_scope decides)."""
    return await read_scope(caller, "accessible")


async def runs_page(caller: Caller, stub: TimedStub, offset: int) -> Page:
    scope = await scope_of(caller)
    listed = await runs.list_training_runs(scope, stub, RUNS_PER_PAGE, offset)
    return {
        "runs": listed.training_runs,
        "cursor": listed.cursor,
        "all_owners": scope.all_owners,
        "me": caller.owner,
        "per_page": RUNS_PER_PAGE,
    }


@dataclass(frozen=True)
class RunUsage:
    steps: int
    tokens_trained: int
    checkpoints: int
    checkpoint_bytes: int


async def run_page(caller: Caller, stub: TimedStub, run_id: str) -> Page:
    scope = await scope_of(caller)
    run = await runs.get_training_run(run_id, scope, stub)
    ckpts = (await runs.list_run_checkpoints(run_id, scope, stub, 10_000, 0)).checkpoints
    usage = RunUsage(
        run.steps or 0,
        run.tokens_trained or 0,
        len(ckpts),
        sum(c.size_bytes or 0 for c in ckpts),
    )
    return {
        "run": run,
        "checkpoints": ckpts,
        "usage": usage,
        "own": run.model_owner == caller.owner,  # actions need the run's own key
        **await run_live(caller, stub, run_id),
    }


async def run_live(caller: Caller, stub: TimedStub, run_id: str) -> Page:
    """The part of a run's page that moves: its charts and its futures in flight."""
    scope = await scope_of(caller)
    history = await runs.get_run_history(run_id, scope, stub, chart.MAX_POINTS)
    futures = await runs.list_run_futures(run_id, scope, stub)
    charts, others = metric_charts(history)
    return {
        "run_id": run_id,
        "history": history,
        "charts": charts,
        "others": others,
        **{"futures": futures},
    }


def metric_charts(history: rs.RunHistoryResponse) -> tuple[list[LineChart], list[str]]:
    """A chart per metric, losses first, at most CHARTS_PER_RUN; the other metrics' names."""
    names: dict[str, None] = {}
    for s in history.steps:
        names.update(dict.fromkeys(s.metrics))
    ordered = sorted(names, key=lambda n: ("loss" not in n, n.count("/"), n))
    charts = []
    for name in ordered[:CHARTS_PER_RUN]:
        steps = [s for s in history.steps if name in s.metrics]
        per_point = max((s.steps for s in steps), default=1)
        xs, ys = [float(s.step) for s in steps], [s.metrics[name] for s in steps]
        charts.append(line_chart(name, xs, ys, per_point))
    return charts, ordered[CHARTS_PER_RUN:]


async def usage_page(request: Request, caller: Caller, stub: TimedStub) -> Page:
    scope = await scope_of(caller)
    usage = await accounting.daily_usage(request, scope, stub, USAGE_DAYS)
    charts: list[tuple[str, BarChart, BarChart]] = []
    for key in usage.keys:
        days = [d.day.strftime("%m-%d") for d in key.days]
        charts.append(
            (
                key.owner,
                bar_chart("tokens trained", days, [float(d.tokens_trained) for d in key.days]),
                bar_chart("tokens sampled", days, [float(d.tokens_sampled) for d in key.days]),
            )
        )
    return {"usage": usage, "charts": charts, "me": caller.owner, "days": USAGE_DAYS}


async def playground_page(caller: Caller, stub: TimedStub) -> Page:
    caps = await runs.get_server_capabilities(caller.owner, stub)
    own = await runs.list_checkpoints(caller.owner, stub, 1000, 0)
    samplers = [c for c in own.checkpoints if c.checkpoint_type == "sampler"]
    models = [m for m in caps.supported_models if m.model_name]
    images = any("image" in (m.sampler_inputs or []) for m in models)
    return {"models": models, "samplers": samplers, "images": images}


async def clock_panel(watch: ClockWatch) -> Page:
    return {"clock": await watch.rates(), "clock_error": watch.error, "wired": watch.url}
