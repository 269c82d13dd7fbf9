"""What every gateway op declares (`GatewayOp`); the route that serves it is built from this by
`registry.router`, the same for every op: authenticate, build the `SubmitRequest`, one
`Scheduler.Submit`, answer the future."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from fastapi import Response
from google.protobuf.message import Message
from pydantic import BaseModel

from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.common import optional_str
from lockstep.gateway.translate.futures import PROTOBUF
from lockstep.v1 import scheduler_pb2 as pb


def future(reply: pb.SubmitReply) -> rs.UntypedAPIFuture:
    return rs.UntypedAPIFuture(request_id=reply.request_id, model_id=optional_str(reply.model_id))


class GatewayOp(ABC):
    name: ClassVar[str]  # the endpoint's name (its OpenAPI operation)
    path: ClassVar[str]  # its route, e.g. "/api/v1/optim_step"
    tag: ClassVar[str]  # its OpenAPI tag
    oneof: ClassVar[str]  # the SubmitRequest field it builds: its scheduler op arrives there
    result: ClassVar[str]  # the JobResult field its future is answered with (`answer`)
    # Takes a place in a model's seq_id order (model_id + seq_id): a refusal at the gateway
    # still holds that seq_id (lockstep.gateway.refusals).
    sequenced: ClassVar[bool]
    # Every training step or sample calls it: its route is served by the direct layer
    # (`gateway/direct.py`) without FastAPI's routing and dependency solving.
    hot: ClassVar[bool] = False
    # The JSON request model the route validates (None: the op reads its raw body).
    body: ClassVar[type[BaseModel] | None]
    response_model: ClassVar[type[BaseModel]] = rs.UntypedAPIFuture
    creates_run: ClassVar[bool] = False  # carries the key's run quota (keys file) to admission
    openapi_extra: ClassVar[dict[str, object] | None] = None  # a raw body's documented forms
    documented: ClassVar[tuple[type[BaseModel], ...]] = ()  # the models openapi_extra names

    @abstractmethod
    async def submit_request(self, owner: str, body: Any) -> pb.SubmitRequest:
        """The scheduler request from `body` (the validated request model, or the HTTP
        `Request` of an op that reads its raw body); a bad address is a 400."""

    def response(self, reply: pb.SubmitReply, body: Any) -> BaseModel:
        """What the client is answered: the future of its request."""
        return future(reply)

    @abstractmethod
    def answer(self, result: pb.JobResult, request_type: str | None) -> Response:
        """Its finished future, as `retrieve_future` answers it (`request_type`: the SDK's
        X-Tinker-Request-Type header, where the result alone does not say)."""


def protobuf(message: Message) -> Response:
    """A result the SDK reads as protobuf (forward_backward, sample)."""
    return Response(message.SerializeToString(), media_type=PROTOBUF)
