"""forward_backward (and forward: `forward_only`): the SDK's protobuf body, or its JSON form.

The body goes to the scheduler as it came (decoded once, here, into the SubmitRequest): what it
carries is the scheduler's to judge (`scheduler/ops/forward_backward.py`), the gateway checks
its address only.
"""

from __future__ import annotations

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from lockstep.gateway.body import is_json, request_body
from lockstep.gateway.openapi import body_ref
from lockstep.gateway.ops.base import GatewayOp, protobuf
from lockstep.gateway.schema.requests import ForwardBackwardJsonRequest
from lockstep.gateway.translate.training import (
    forward_backward_from_json,
    forward_backward_from_proto,
)
from lockstep.v1 import scheduler_pb2 as pb


class ForwardBackward(GatewayOp):
    name = "forward_backward"
    path = "/api/v1/forward_backward"
    tag = "training"
    oneof = "forward_backward"
    result = "forward_backward"
    sequenced = True
    hot = True
    body = None  # protobuf (what the SDK sends; zstd already undone) or JSON
    documented = (ForwardBackwardJsonRequest,)
    openapi_extra = body_ref(
        ForwardBackwardJsonRequest,
        protobuf="tinker.ForwardBackwardRequest (the SDK's form), "
        "optionally zstd/gzip-compressed (Content-Encoding)",
    )

    async def submit_request(self, owner: str, body: Request) -> pb.SubmitRequest:
        raw = request_body(body.scope)  # read once, by the body-limit middleware
        if is_json(body.headers.get("content-type")):
            try:
                parsed = ForwardBackwardJsonRequest.model_validate_json(raw)
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from e
            return forward_backward_from_json(owner, parsed)
        return forward_backward_from_proto(owner, raw)

    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        return protobuf(result.forward_backward)
