"""A session's custom losses: checked, priced and stored at creation, attached to every request
that names one, gone with the session. The scheduler's one module for them.

- `CustomLosses.create` answers create_custom_loss at once (its future is already finished):
  the graph's structure against the allowlist (`lockstep/custom_loss/graph.py`), then its price
  on probe shapes (`lockstep/custom_loss/pricing.py`: FLOPs and peak temporary memory on meta
  tensors, against `bound.py`'s bound), then the store and the usage counter. Its id is
  `<session_id>:loss:<custom_loss_seq_id>`, so a retried create (same seq id, same loss) answers
  the same id and a different loss under a used seq id is a 400.
- `attach` is the one way a request gets its loss: at its admission (`ops/forward_backward.py`:
  the loss must be one of the model's session's) and at dispatch and replay (rebuilt from the
  stored record). `CustomLosses.check_data` then judges each datum at admission: its inputs at
  their declared ranks (`graph.check_datum`) and its price on its shapes within the bound. So a
  graph or datum the engine should not run is a 400 naming the node before it is queued.
- A stored loss lives as long as its session: a restarted scheduler or an engine replaying a
  pass still finds it, and the session's end (closed, or silent past the expiry) deletes it
  (`delete_session`).

The scheduler never imports torch: pricing runs in a worker process of its own
(`lockstep/custom_loss/pricer.py`), started on first use.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from lockstep.custom_loss import graph
from lockstep.custom_loss.bound import CostBound
from lockstep.custom_loss.pricer import Pricer
from lockstep.engine.capabilities import TrainerCapabilities
from lockstep.engine.losses import CUSTOM, custom_loss_id
from lockstep.engine.types import CustomLoss, CustomLossNode, PassRequest
from lockstep.errors import UserInputError
from lockstep.scheduler.state import keys
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.records import CustomLossRecord, ModelRecord, decode, encoder
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

MAX_LOSSES_PER_SESSION = 256
Created = Callable[[CustomLossRecord], Awaitable[None]]  # usage: a loss was stored


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


async def attach(store: Store, req: PassRequest, model: ModelRecord | None = None) -> None:
    """Attach the loss a custom request names (a built-in loss has none): at its admission,
    given its `model`, only one of that model's session's; at dispatch and replay (checked at
    its submission), rebuilt from the stored record."""
    if req.loss_fn != CUSTOM:
        return
    loss_id = custom_loss_id(req.loss_config)
    rec = await record(store, loss_id)
    if model is None:
        if rec is None:
            raise UserInputError(
                "loss_fn_config.loss_id",
                f"custom loss {loss_id[:80]!r} is gone (it left with its session)",
            )
    elif rec is None or rec.owner != model.owner or rec.session_id != model.session_id:
        raise UserInputError(
            "loss_fn_config.loss_id",
            f"{loss_id[:80]!r} names no custom loss of this model's session "
            f"({model.session_id}); create it with create_custom_loss in that session",
        )
    req.custom_loss = loss_from_record(rec)


class CustomLosses:
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        bound: CostBound,
        max_tokens: int,
        trainer: TrainerCapabilities,
        created: Created | None = None,
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.bound = bound  # what one datum's loss may cost (reported by get_info)
        self.max_tokens = max_tokens  # the longest datum the server accepts
        self.created = created
        self.trainer = trainer  # whether the training engine runs them at all
        self.pricer = Pricer()  # its own process: pricing never holds the scheduler's loop

    async def create(self, req: pb.CreateCustomLossRequest) -> pb.SubmitReply:
        """Check, price and store a loss; answered as an already finished future."""
        session = await self.catalog.live_session(req.owner, req.session_id)
        self.trainer.check_custom_losses()
        if req.custom_loss_seq_id < 0:
            raise UserInputError("custom_loss_seq_id", "must be >= 0")
        loss_id = f"{session.session_id}:loss:{req.custom_loss_seq_id}"
        inputs = [(x.name, x.rank) for x in req.inputs]
        loss = graph.build_loss(loss_id, req.name, inputs, nodes_of(req.graph_json))
        await self.pricer.check_created(loss, self.bound, self.max_tokens)
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
        if await put(self.store, rec) and self.created is not None:
            await self.created(rec)
        result = pb.JobResult(custom_loss=pb.CustomLossResult(loss_id=loss_id))
        rid = await self.store.jobs.finished(OpKind.CREATE_CUSTOM_LOSS, req.owner, result)
        return pb.SubmitReply(request_id=rid)

    async def check_data(self, req: PassRequest) -> None:
        """Each datum of a request against the loss attached to it: its inputs at their
        declared ranks (`graph.check_datum`), then the loss's price on its shapes within the
        bound (in the pricing process)."""
        loss = req.custom_loss
        if loss is None:
            return
        for i, datum in enumerate(req.data):
            graph.check_datum(loss, datum, i)
        await self.pricer.check_data(loss, req.data, self.bound)
