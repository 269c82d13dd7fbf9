"""A session's custom losses: checked and stored at creation, found again for each request.

`create` checks a graph twice before it is stored: its structure against the allowlist (plain
data, `lockstep.engine.custom_loss`), then a run on meta tensors of probe shapes (no values are
computed: `lockstep.training.custom_loss.dry_run`). A stored loss lives in Redis like the rest
of its session, without expiry, so a restarted scheduler or an engine replaying a pass still
finds it. Its id is `<session_id>:loss:<custom_loss_seq_id>`, so a retried create (same seq id,
same loss) answers the same id and a different loss under a used seq id is a 400.

A request that names a loss (`loss_fn="custom"`) is checked at submission against the loss's
declared input ranks and, on each datum's own shapes, against the size limits (`named`, then
`check_sizes`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from types import ModuleType
from typing import Any

import msgspec

from lockstep.engine import custom_loss as spec
from lockstep.engine.losses import CUSTOM, custom_loss_id
from lockstep.engine.types import CustomLoss, CustomLossNode, PassRequest
from lockstep.errors import UserInputError
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.catalog import Catalog, NotFound
from lockstep.scheduler.state.records import CustomLossRecord, ModelRecord, decode, encoder
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

MAX_LOSSES_PER_SESSION = 256


class _Node(msgspec.Struct, forbid_unknown_fields=True):
    op: str
    name: str
    target: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class _Graph(msgspec.Struct, forbid_unknown_fields=True):
    nodes: list[_Node]
    format: int = spec.GRAPH_FORMAT


def _nodes(graph_json: bytes) -> list[CustomLossNode]:
    try:
        graph = msgspec.json.decode(graph_json, type=_Graph)
    except msgspec.DecodeError as exc:
        raise UserInputError("graph", f"not a custom loss graph: {exc}") from None
    if graph.format != spec.GRAPH_FORMAT:
        raise UserInputError("graph.format", f"format {graph.format} is not supported; use 1")
    return [CustomLossNode(n.op, n.name, n.target, tuple(n.args), n.kwargs) for n in graph.nodes]


def loss_from_record(rec: CustomLossRecord) -> CustomLoss:
    return spec.build_loss(rec.loss_id, rec.name, list(rec.inputs), _nodes(rec.graph_json))


def _torch_side() -> ModuleType:
    """The torch half, imported on first use: the scheduler needs torch only for custom losses
    (its checks run on meta tensors, in a thread)."""
    from lockstep.training import custom_loss

    return custom_loss


class CustomLosses:
    def __init__(self, store: Store, catalog: Catalog) -> None:
        self.store = store
        self.catalog = catalog

    async def create(self, req: pb.CreateCustomLossRequest) -> pb.SubmitReply:
        """Check and store a loss; answered as an already finished future."""
        session = await self.catalog.live_session(req.owner, req.session_id)
        if req.custom_loss_seq_id < 0:
            raise UserInputError("custom_loss_seq_id", "must be >= 0")
        loss_id = f"{session.session_id}:loss:{req.custom_loss_seq_id}"
        inputs = [(x.name, x.rank) for x in req.inputs]
        loss = spec.build_loss(loss_id, req.name, inputs, _nodes(req.graph_json))
        await asyncio.to_thread(lambda: _torch_side().check_created(loss))
        digest = hashlib.sha256(
            msgspec.json.encode([req.name, inputs]) + b"\0" + req.graph_json
        ).hexdigest()
        rec = CustomLossRecord(
            loss_id,
            req.owner,
            session.session_id,
            req.custom_loss_seq_id,
            req.name,
            inputs,
            req.graph_json,
            digest,
            time.time(),
        )
        await self._put(rec)
        result = pb.JobResult(custom_loss=pb.CustomLossResult(loss_id=loss_id))
        return await self._finished(req.owner, result)

    async def _put(self, rec: CustomLossRecord) -> None:
        key = keys.custom_loss(rec.loss_id)
        members = keys.session_losses(rec.session_id)
        if not await self.store.redis.set(key, encoder.encode(rec), nx=True):
            old = await self._record(rec.loss_id)
            if old is None or old.digest != rec.digest:
                raise UserInputError(
                    "custom_loss_seq_id",
                    f"{rec.seq_id} was already used by a different loss in this session; "
                    "seq ids must not be reused",
                )
            return  # a retry: same id
        await self.store.redis.sadd(members, rec.loss_id)
        if await self.store.redis.scard(members) > MAX_LOSSES_PER_SESSION:
            await self.store.redis.srem(members, rec.loss_id)
            await self.store.redis.delete(key)
            raise UserInputError(
                "custom_loss_seq_id",
                f"this session already holds {MAX_LOSSES_PER_SESSION} custom losses",
            )

    async def _finished(self, owner: str, result: pb.JobResult) -> pb.SubmitReply:
        rid = await self.store.jobs.finished(OpKind.CREATE_CUSTOM_LOSS, owner, result)
        return pb.SubmitReply(request_id=rid)

    async def _record(self, loss_id: str) -> CustomLossRecord | None:
        return await _record(self.store, loss_id)

    async def for_model(self, model: ModelRecord, loss_id: str) -> CustomLoss:
        """The loss a request of `model` names: one of its own session's."""
        rec = await self._record(loss_id)
        if rec is None or rec.owner != model.owner or rec.session_id != model.session_id:
            raise UserInputError(
                "loss_fn_config.loss_id",
                f"{loss_id[:80]!r} names no custom loss of this model's session "
                f"({model.session_id}); create it with create_custom_loss in that session",
            )
        return loss_from_record(rec)

    async def named(self, model: ModelRecord, req: PassRequest) -> CustomLoss | None:
        """The loss a request names (None for a built-in loss)."""
        if req.loss_fn != CUSTOM:
            return None
        return await self.for_model(model, custom_loss_id(req.loss_config))

    @staticmethod
    async def check_sizes(req: PassRequest) -> None:
        """After the rank checks: the loss on each datum's own shapes stays within the limits
        and returns scalars (a meta-tensor run: nothing is computed)."""
        loss = req.custom_loss
        if loss is not None:
            await asyncio.to_thread(lambda: _torch_side().check_data(loss, req.data))


async def _record(store: Store, loss_id: str) -> CustomLossRecord | None:
    raw = await store.redis.get(keys.custom_loss(loss_id))
    return None if raw is None else decode(raw, CustomLossRecord)


async def attach(store: Store, req: PassRequest) -> None:
    """Attach the loss a queued custom request names (checked at its submission): dispatch and
    replay rebuild it from the stored record."""
    if req.loss_fn != CUSTOM:
        return
    rec = await _record(store, custom_loss_id(req.loss_config))
    if rec is None:
        raise NotFound(f"custom loss {req.loss_config.get('loss_id')} is gone")
    req.custom_loss = loss_from_record(rec)
