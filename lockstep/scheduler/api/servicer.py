"""The gRPC servicer, composed: each role object (`future_rpcs`, `catalog_rpcs`,
`tenancy_rpcs`) serves a table of RPCs, and every handler runs under the ONE error mapping
below.

A role's handler takes the request and returns the reply; it raises domain errors
(`UserInputError`, `NotFound`, `OverCapacity`, Redis unreachable) and never sees the gRPC
context. Building the servicer checks that every RPC of the proto has exactly one role.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

import grpc

from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.scheduler.state import redis_conn
from lockstep.scheduler.state.catalog import NotFound, OverCapacity
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]
GrpcHandler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]

# Every RPC the proto declares, in its order.
RPCS = tuple(m.name for m in pb.DESCRIPTOR.services_by_name["Scheduler"].methods)


class Role(Protocol):
    def rpcs(self) -> Mapping[str, Handler]:
        """The RPCs this role serves, by their proto name."""
        ...


def mapped(method: str, handler: Handler) -> GrpcHandler:
    """The one error mapping: domain errors to gRPC status codes (the gateway maps those to
    HTTP); the handler is timed and its Redis round trips labelled with the method."""
    caller = f"rpc:{method}"

    async def serve(request: Any, context: grpc.aio.ServicerContext) -> Any:
        token = metrics.REDIS_CALLER.set(caller)
        start = time.perf_counter()
        try:
            return await handler(request)
        except UserInputError as exc:
            metrics.refused("INVALID_ARGUMENT")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NotFound as exc:
            metrics.refused("NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except OverCapacity as exc:
            metrics.refused("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except redis_conn.OUT_OF_MEMORY as exc:  # a write Redis refused at its memory limit
            log.warning("%s: redis is full: %s", method, exc)
            metrics.refused("RESOURCE_EXHAUSTED")
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "the state store (Redis) is at its memory limit; retry later",
            )
        except redis_conn.UNAVAILABLE_ERRORS as exc:  # still down after the client's retries
            log.warning("%s: redis unavailable: %s", method, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "state store unavailable, retry")
        finally:
            metrics.RPC_SECONDS.labels(method).observe(time.perf_counter() - start)
            metrics.REDIS_CALLER.reset(token)

    serve.__name__ = method
    return serve


def servicer(*roles: Role) -> pb_grpc.SchedulerServicer:
    """One servicer over `roles`; a ValueError if an RPC has no role or two."""
    table: dict[str, Handler] = {}
    for role in roles:
        for name, handler in role.rpcs().items():
            if name not in RPCS:
                raise ValueError(f"{type(role).__name__} serves {name}, which the proto lacks")
            if name in table:
                raise ValueError(f"RPC {name} has two roles")
            table[name] = handler
    missing = [name for name in RPCS if name not in table]
    if missing:
        raise ValueError(f"no role serves {missing}")
    out = pb_grpc.SchedulerServicer()
    for name, handler in table.items():
        setattr(out, name, mapped(name, handler))
    return out
