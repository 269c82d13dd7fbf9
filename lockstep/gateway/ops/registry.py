"""The gateway's op registry: every op the SDK submits, and the routes built from them. Adding
an op is adding its module to `OPS` (and its scheduler op, `lockstep/scheduler/ops/registry.py`,
and its proto message); tests/unit/test_op_registry.py checks the two registries agree.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import cast

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from lockstep.gateway.deps import CALL_TIMEOUT_S, KeyQuota, Owner, Scheduler
from lockstep.gateway.direct import HotRoute
from lockstep.gateway.ops.base import GatewayOp
from lockstep.gateway.ops.create import CreateModel
from lockstep.gateway.ops.forward_backward import ForwardBackward
from lockstep.gateway.ops.load import LoadWeights
from lockstep.gateway.ops.optim_step import OptimStep
from lockstep.gateway.ops.sample import Sample
from lockstep.gateway.ops.save import SaveWeights, SaveWeightsExternal, SaveWeightsForSampler
from lockstep.gateway.stub import TimedStub
from lockstep.v1 import scheduler_pb2 as pb

OPS: tuple[GatewayOp, ...] = (
    CreateModel(),
    ForwardBackward(),
    OptimStep(),
    SaveWeights(),
    SaveWeightsForSampler(),
    SaveWeightsExternal(),
    LoadWeights(),
    Sample(),
)


def _check(ops: Iterable[GatewayOp]) -> tuple[GatewayOp, ...]:
    seen: set[str] = set()
    for op in ops:
        if op.path in seen:
            raise ValueError(f"two ops serve {op.path}")
        seen.add(op.path)
    return tuple(ops)


_ops = _check(OPS)
_sequenced = frozenset(op.path for op in _ops if op.sequenced)


def ops() -> tuple[GatewayOp, ...]:
    return _ops


def sequenced_paths() -> frozenset[str]:
    """The routes whose requests take a place in a model's seq_id order (a refusal holds it)."""
    return _sequenced


@contextmanager
def registered(*extra: GatewayOp) -> Iterator[None]:
    """Serve `extra` ops too while the block runs (an app built inside it has their routes)."""
    global _ops, _sequenced
    before = _ops, _sequenced
    _ops = _check((*_ops, *extra))
    _sequenced = frozenset(op.path for op in _ops if op.sequenced)
    try:
        yield
    finally:
        _ops, _sequenced = before


def answer(result: pb.JobResult, request_type: str | None) -> Response | None:
    """A finished future's answer, by the op its result belongs to (None: not an op's)."""
    kind = result.WhichOneof("result")
    op = next((op for op in _ops if op.result == kind), None)
    return None if op is None else op.answer(result, request_type)


def _endpoint(op: GatewayOp) -> Callable[..., Awaitable[BaseModel]]:
    """The route of `op`: one Submit, answered with its future."""

    async def endpoint(**params: object) -> BaseModel:
        body, stub = params["body"], cast(TimedStub, params["stub"])
        request = await op.submit_request(str(params["owner"]), body)
        if op.creates_run:  # the keys file's quota, if any
            request.key_max_training_runs = cast(int, params["quota"])
        reply = await stub.Submit(request, timeout=CALL_TIMEOUT_S)
        return op.response(reply, body)

    # FastAPI reads the signature: the validated body (or the raw request), the caller and
    # the scheduler stub.
    kw = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        inspect.Parameter("body", kw, annotation=Request if op.body is None else op.body),
        inspect.Parameter("owner", kw, annotation=Owner),
        inspect.Parameter("stub", kw, annotation=Scheduler),
    ]
    if op.creates_run:
        parameters.append(inspect.Parameter("quota", kw, annotation=KeyQuota))
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        parameters, return_annotation=op.response_model
    )
    endpoint.__name__ = endpoint.__qualname__ = op.name
    endpoint.__doc__ = op.__doc__
    return endpoint


def router() -> APIRouter:
    """Every registered op's route; a hot op's is a `HotRoute` (the direct layer serves it)."""
    out = APIRouter()
    for op in _ops:
        out.add_api_route(
            op.path,
            _endpoint(op),
            methods=["POST"],
            tags=[op.tag],
            response_model=op.response_model,
            openapi_extra=op.openapi_extra,
            route_class_override=HotRoute if op.hot else None,
        )
    return out
