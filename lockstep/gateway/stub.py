"""The scheduler stub the routes call: every call timed in `lockstep_grpc_client_duration_seconds`.

With the scheduler's own handler time (`lockstep_rpc_duration_seconds`) this splits a request's
time between the gateway, the gRPC hop and the scheduler (benchmarks/control_plane.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import grpc

from lockstep.observability import gateway_metrics
from lockstep.v1 import scheduler_pb2_grpc

P = ParamSpec("P")
R = TypeVar("R")


def _timed(method: str, call: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    async def timed(*args: P.args, **kwargs: P.kwargs) -> R:
        start = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            gateway_metrics.grpc_call(method, time.perf_counter() - start)

    return timed


class TimedStub(scheduler_pb2_grpc.SchedulerStub):
    """A `SchedulerStub` whose unary methods (all of them) are timed; same call signature."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        super().__init__(channel)  # type: ignore[no-untyped-call]  # generated, unannotated
        for method, call in list(vars(self).items()):
            setattr(self, method, _timed(method, call))
