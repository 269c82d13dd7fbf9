"""A training request the gateway refuses still uses its seq_id.

The SDK numbers a model's requests 1, 2, 3, ... and moves on to the next number as soon as a
submission is answered, even with a 400. The scheduler runs a model's requests strictly in
order, so a refused number must be recorded (as failed) or every later request of that model
would wait for it forever. Best effort: if the body does not even say which model and seq_id it
is, there is nothing to hold.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from fastapi import Request

from lockstep.gateway.deps import CALL_TIMEOUT_S, authenticate
from lockstep.v1 import scheduler_pb2 as pb

log = logging.getLogger("lockstep.gateway")

SEQUENCED_PATHS = frozenset(
    {
        "/api/v1/forward_backward",
        "/api/v1/optim_step",
        "/api/v1/save_weights",
        "/api/v1/save_weights_for_sampler",
        "/api/v1/save_weights_external",
        "/api/v1/load_weights",
    }
)


async def hold_seq(stub: Any, owner: str, model_id: Any, seq_id: Any, reason: str) -> None:
    if not isinstance(model_id, str) or not isinstance(seq_id, int) or seq_id < 1:
        return
    refused = pb.Refused(model_id=model_id, seq_id=seq_id, reason=reason)
    try:
        await stub.Submit(pb.SubmitRequest(owner=owner, refused=refused), timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:  # the 400 still goes out; log why the hold did not
        log.warning("could not hold seq %s of %s: %s", seq_id, model_id, exc.details())


async def hold_seq_of_request(request: Request, body: Any, reason: str) -> None:
    """Hold the seq_id named in a refused request's (already parsed) JSON body."""
    if not any(request.url.path.endswith(p) for p in SEQUENCED_PATHS):
        return
    if not isinstance(body, dict):
        return
    try:
        owner = authenticate(request.app.state.settings, request.headers.get("x-api-key"))
    except Exception:
        return  # unauthenticated: nothing of theirs to hold
    await hold_seq(
        request.app.state.scheduler, owner, body.get("model_id"), body.get("seq_id"), reason
    )
