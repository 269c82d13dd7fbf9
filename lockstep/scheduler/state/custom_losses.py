"""A session's custom losses in Redis: stored at creation, found again for each request, gone
with the session.

A store only: what a loss may be and what it may cost is the admission's to judge
(`scheduler/admission/custom_losses.py`), before `put`. A stored loss lives as long as its
session: a restarted scheduler or an engine replaying a pass still finds it, and the session's
end (closed, or silent past the expiry) deletes it (`delete_session`). Its id is
`<session_id>:loss:<custom_loss_seq_id>`, so a retried create (same seq id, same loss) answers
the same id and a different loss under a used seq id is a 400.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lockstep.custom_loss import graph
from lockstep.engine.losses import CUSTOM, custom_loss_id
from lockstep.engine.types import CustomLoss, CustomLossNode, PassRequest
from lockstep.errors import UserInputError
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.records import CustomLossRecord, decode, encoder
from lockstep.scheduler.state.store import Store

MAX_LOSSES_PER_SESSION = 256


class _Node(msgspec.Struct, forbid_unknown_fields=True):
    op: str
    name: str
    target: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class _Graph(msgspec.Struct, forbid_unknown_fields=True):
    nodes: list[_Node]
    format: int = graph.GRAPH_FORMAT


def nodes_of(graph_json: bytes) -> list[CustomLossNode]:
    """The nodes of a graph as the SDK encodes it (JSON)."""
    try:
        decoded = msgspec.json.decode(graph_json, type=_Graph)
    except msgspec.DecodeError as exc:
        raise UserInputError("graph", f"not a custom loss graph: {exc}") from None
    if decoded.format != graph.GRAPH_FORMAT:
        raise UserInputError("graph.format", f"format {decoded.format} is not supported; use 1")
    return [CustomLossNode(n.op, n.name, n.target, tuple(n.args), n.kwargs) for n in decoded.nodes]


def loss_from_record(rec: CustomLossRecord) -> CustomLoss:
    return graph.build_loss(rec.loss_id, rec.name, list(rec.inputs), nodes_of(rec.graph_json))


async def put(store: Store, rec: CustomLossRecord) -> bool:
    """Store a checked loss; False if this very loss was stored already (a retry).

    Raises:
        UserInputError: the seq id holds another loss, or the session holds its most.
    """
    key = keys.custom_loss(rec.loss_id)
    members = keys.session_losses(rec.session_id)
    if not await store.redis.set(key, encoder.encode(rec), nx=True):
        old = await record(store, rec.loss_id)
        if old is None or old.digest != rec.digest:
            raise UserInputError(
                "custom_loss_seq_id",
                f"{rec.seq_id} was already used by a different loss in this session; "
                "seq ids must not be reused",
            )
        return False
    await store.redis.sadd(members, rec.loss_id)
    if await store.redis.scard(members) > MAX_LOSSES_PER_SESSION:
        await store.redis.srem(members, rec.loss_id)
        await store.redis.delete(key)
        raise UserInputError(
            "custom_loss_seq_id",
            f"this session already holds {MAX_LOSSES_PER_SESSION} custom losses",
        )
    return True


async def record(store: Store, loss_id: str) -> CustomLossRecord | None:
    raw = await store.redis.get(keys.custom_loss(loss_id))
    return None if raw is None else decode(raw, CustomLossRecord)


async def delete_session(store: Store, session_id: str) -> int:
    """Delete every loss of an ended session; how many there were."""
    members = keys.session_losses(session_id)
    ids = [raw.decode() for raw in await store.redis.smembers(members)]
    await store.redis.delete(members, *(keys.custom_loss(i) for i in ids))
    return len(ids)


async def attach(store: Store, req: PassRequest) -> None:
    """Attach the loss a queued custom request names (checked at its submission): dispatch and
    replay rebuild it from the stored record."""
    if req.loss_fn != CUSTOM:
        return
    rec = await record(store, custom_loss_id(req.loss_config))
    if rec is None:
        raise UserInputError(
            "loss_fn_config.loss_id",
            f"custom loss {req.loss_config.get('loss_id')} is gone (it left with its session)",
        )
    req.custom_loss = loss_from_record(rec)
