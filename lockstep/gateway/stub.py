"""The scheduler stub the routes call: every call timed in `lockstep_grpc_client_duration_seconds`.

With the scheduler's own handler time (`lockstep_rpc_duration_seconds`) this splits a request's
time between the gateway, the gRPC hop and the scheduler (benchmarks/control_plane.py).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from lockstep.observability import gateway_metrics
from lockstep.v1 import scheduler_pb2_grpc


def _timed(method: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return await call(*args, **kwargs)
        finally:
            gateway_metrics.grpc_call(method, time.perf_counter() - start)

    return timed


class TimedStub:
    """A `SchedulerStub` whose unary methods (all of them) are timed; same call signature."""

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub) -> None:
        for method, call in vars(stub).items():
            setattr(self, method, _timed(method, call))
