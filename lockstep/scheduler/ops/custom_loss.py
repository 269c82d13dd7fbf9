"""create_custom_loss, and the custom-loss rules of a forward_backward that names one.

Creation is answered at submission (its future is already finished): the graph's structure
against the allowlist (`custom_loss.graph`), then its price on probe shapes (`custom_loss.
pricing`: FLOPs and peak temporary memory on meta tensors, against `bound`), then the store
(`scheduler/state/custom_losses.py`) and the usage counter. A forward_backward naming a loss is
checked at its admission (`ops/forward_backward.py` calls `named` and `check_data`): the loss is
one of the model's session's, each datum's inputs have their declared ranks, and the loss costs
no more than the bound on that datum's shapes. So a graph or datum the engine should not run is
a 400 naming the node before it is queued.

The scheduler never imports torch: pricing runs in a worker process of its own
(`custom_loss/pricer.py`), started on first use.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable

import msgspec

from lockstep.custom_loss import graph
from lockstep.custom_loss.bound import CostBound
from lockstep.custom_loss.pricer import Pricer
from lockstep.engine.capabilities import TrainerCapabilities
from lockstep.engine.losses import CUSTOM, custom_loss_id
from lockstep.engine.types import CustomLoss, PassRequest
from lockstep.errors import UserInputError
from lockstep.scheduler.state import custom_losses as stored
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.records import CustomLossRecord, ModelRecord
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

Created = Callable[[CustomLossRecord], Awaitable[None]]  # usage: a loss was stored


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
        loss = graph.build_loss(loss_id, req.name, inputs, stored.nodes_of(req.graph_json))
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
        if await stored.put(self.store, rec) and self.created is not None:
            await self.created(rec)
        result = pb.JobResult(custom_loss=pb.CustomLossResult(loss_id=loss_id))
        rid = await self.store.jobs.finished(OpKind.CREATE_CUSTOM_LOSS, req.owner, result)
        return pb.SubmitReply(request_id=rid)

    async def named(self, model: ModelRecord, req: PassRequest) -> CustomLoss | None:
        """The loss a request names (None for a built-in loss): one of its model's session's."""
        if req.loss_fn != CUSTOM:
            return None
        loss_id = custom_loss_id(req.loss_config)
        rec = await stored.record(self.store, loss_id)
        if rec is None or rec.owner != model.owner or rec.session_id != model.session_id:
            raise UserInputError(
                "loss_fn_config.loss_id",
                f"{loss_id[:80]!r} names no custom loss of this model's session "
                f"({model.session_id}); create it with create_custom_loss in that session",
            )
        return stored.loss_from_record(rec)

    async def check_data(self, req: PassRequest) -> None:
        """Each datum against the loss the request names: its inputs at their declared ranks,
        then the loss's price on its shapes within the bound."""
        loss = req.custom_loss
        if loss is None:
            return
        for i, datum in enumerate(req.data):
            graph.check_datum(loss, datum, i)
        await self.pricer.check_data(loss, req.data, self.bound)
