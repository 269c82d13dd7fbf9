"""Submit: validate a request against the scheduler's state and enqueue it exactly once.

Everything that can be rejected is rejected here, before it is queued, so a bad request gets a
400 naming its field and never reaches the engine. What each op checks and queues is its own
module's rule (`scheduler/ops/`); this module queues it: in its model's seq_id order, in the
sampling queue, or as a refusal that only holds its seq_id.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from lockstep.config import Limits
from lockstep.custom_loss.bound import CostBound
from lockstep.engine.capabilities import Engines
from lockstep.engine.images import ImageLimits, ImageReader
from lockstep.engine.types import NO_MEMORY_LIMIT, MemoryBudget, ModelCard
from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.scheduler.admission.decoded import DecodedPasses, DecodedSamples
from lockstep.scheduler.observers import tracing
from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import Claim, Hold, SampleClaim, SubmitContext
from lockstep.scheduler.state.catalog import Catalog, NotFound, OverCapacity
from lockstep.scheduler.state.claims import (
    ClaimConflict,
    NotLive,
    QueueFull,
    SeqExpired,
    TenantLimitReached,
    TrainingClaim,
    new_request_id,
)
from lockstep.scheduler.state.custom_losses import Created, CustomLosses
from lockstep.scheduler.state.memory import RedisFull
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind

# Every limit is in lockstep.config.Limits. Admission: past the backlog limits a submission is
# told to come back later (HTTP 429, retried by the SDK with backoff) instead of growing the
# queue without bound; the size and tenant limits are permanent (400, naming the limit).


def retry_identity(req: pb.SubmitRequest) -> bytes | None:
    """What a retry of `req` must repeat to count as the same request (None: its payload); its
    op says (e.g. an ephemeral save_weights_for_sampler, `ops/save.py`)."""
    op = registry.BY_ONEOF.get(req.WhichOneof("op") or "")
    return None if op is None else op.identity(req)


class Submissions:
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        card: ModelCard,
        engines: Engines,
        data_dir: Path,
        on_training: Callable[[], None],
        on_sample: Callable[[], None],
        limits: Limits | None = None,
        memory_budget: MemoryBudget = NO_MEMORY_LIMIT,
        decoded: DecodedPasses | None = None,
        decoded_samples: DecodedSamples | None = None,
        image_dir: Path | None = None,
        custom_loss_created: Created | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.store = store
        self.card = card
        self.memory = memory_budget  # the training engine's (TrainingEngine.memory_budget)
        self.on_training = on_training
        self.on_sample = on_sample
        self.custom_losses = CustomLosses(
            store,
            catalog,
            CostBound.for_model(card, self.memory),
            self.max_tokens_per_datum(),
            engines.trainer,
            custom_loss_created,
        )
        self.decoded = decoded or DecodedPasses()  # shared with the dispatcher
        self.decoded_samples = decoded_samples or DecodedSamples()  # with the sampling lane
        # What an op's admission reads (scheduler/ops/base.py).
        self.engines = engines
        image_limits = ImageLimits(self.limits.max_image_bytes, self.limits.max_image_pixels)
        self.ctx = SubmitContext(
            store,
            catalog,
            card,
            self.limits,
            self.memory,
            data_dir,
            self.custom_losses,
            ImageReader(card.vision, image_limits, image_dir, engine=engines.trainer),
            engines,
            ImageReader(card.vision, image_limits, image_dir, engine=engines.sampler),
        )

    async def submit(self, req: pb.SubmitRequest) -> pb.SubmitReply:
        try:
            self.store.memory.admit()  # new work waits while Redis is near its memory limit
        except RedisFull as exc:
            raise OverCapacity(str(exc)) from exc
        try:
            try:
                op = registry.arriving_as(req.WhichOneof("op"))
                for verb in op.verbs:  # an engine verb of its own: served here, or refused
                    self.engines.trainer.check_verb(verb, "type")
                admitted = await op.admit(self.ctx, req)
            except (UserInputError, NotFound) as exc:  # e.g. a missing checkpoint to load
                await self._hold_seq(req, req.SerializeToString(deterministic=True), str(exc))
                raise
            # Serialized after admission: an op may resolve what it judged into the request
            # (an image file's bytes in place of its pointer), so what runs is what was judged.
            payload = req.SerializeToString(deterministic=True)
            if isinstance(admitted, Hold):  # the gateway refused it: hold its seq_id only
                await self._hold_seq(req, payload, admitted.reason)
                return pb.SubmitReply()
            if isinstance(admitted, SampleClaim):
                return await self._sample(req, payload, admitted)
            rid = await self._training(req, payload, admitted)
        except TenantLimitReached as exc:
            raise self._tenant_error(exc) from exc
        except SeqExpired as exc:
            raise UserInputError("seq_id", str(exc)) from exc
        except ClaimConflict as exc:
            raise UserInputError(
                "seq_id",
                f"this seq_id was already used by request {exc} with a different "
                "payload; seq_ids must not be reused",
            ) from exc
        self.on_training()
        return pb.SubmitReply(request_id=rid, model_id=admitted.model_id)

    async def _training(self, req: pb.SubmitRequest, payload: bytes, queued: Claim) -> str:
        """Claim a validated training op in its model's seq_id order; its request id."""
        model_id, kind = queued.model_id, queued.kind
        claim = TrainingClaim(
            owner=req.owner,
            model_id=model_id,
            seq_id=queued.seq_id,
            kind=kind,
            payload=payload,
            tokens=queued.tokens,
            new_model=queued.new_model,
            identity=retry_identity(req),
            backlog=self.limits.max_pending_per_model,
            max_runs_per_key=min(
                (q for q in (self.limits.max_tenants_per_key, req.key_max_training_runs) if q),
                default=0,
            ),
            max_runs=self.limits.max_tenants,
            live_session=queued.live_session,
        )
        try:
            rid, created = await self.store.jobs.claim_training(claim)
        except QueueFull as exc:
            raise OverCapacity(
                f"model {model_id} has {exc.queued} requests queued; retry later"
            ) from exc
        except NotLive as exc:  # refused as admission would have: it holds its seq_id
            refusal = self.ctx.catalog.not_live(model_id, queued.live_session or "", exc.state)
            await self._hold_seq(req, payload, str(refusal))
            raise refusal from exc
        metrics.submitted(req.owner, model_id, kind, created)
        if created:
            tracing.submitted(rid)  # [trace hook] queue wait starts
            if queued.decoded is not None:
                self.decoded.keep(rid, queued.decoded)
        return rid

    @staticmethod
    def _addressed(req: pb.SubmitRequest) -> tuple[str, int]:
        """(model_id, seq_id) of a request that takes a place in a model's sequence; ("", 0)
        for one that does not (create_model, create-via-load, sample): its op says."""
        op = registry.BY_ONEOF.get(req.WhichOneof("op") or "")
        return ("", 0) if op is None else op.addressed(req)

    async def _hold_seq(self, req: pb.SubmitRequest, payload: bytes, reason: str) -> None:
        """The one rule for a refused request, whoever refused it: it still uses its seq_id (the
        SDK has moved on to the next one), as a failed request, if the caller owns the model
        and the seq_id is not already taken. Anyone else's request holds nothing."""
        model_id, seq_id = self._addressed(req)
        if not model_id or seq_id < 1:
            return
        model = await self.store.runs.get(model_id)
        if model is None or model.owner != req.owner:
            return
        try:
            await self.store.jobs.claim_training(
                TrainingClaim(
                    owner=req.owner,
                    model_id=model_id,
                    seq_id=seq_id,
                    kind=OpKind.REJECTED,
                    payload=payload,
                    tokens=0,
                    rejection=reason,
                )
            )
        except (ClaimConflict, SeqExpired):
            return  # the seq_id already belongs to another request, or expired with it
        self.on_training()

    async def _sample(
        self, req: pb.SubmitRequest, payload: bytes, s: SampleClaim
    ) -> pb.SubmitReply:
        """Queue a validated sample for the sampling lane, its decoded request held for the lane
        before the lane can see it queued (a busy lane reads the queue at any time)."""
        new = new_request_id()
        if s.decoded is not None:
            self.decoded_samples.keep(new, s.decoded)
        created = False
        try:
            rid, created = await self.store.jobs.claim_sample(
                owner=req.owner,
                sampler_id=s.sampler_id,
                seq_id=s.seq_id,
                payload=payload,
                backlog=self.limits.max_pending_samples,
                live_session=s.live_session,
                request_id=new,
            )
            metrics.submitted(req.owner, s.sampler_id, OpKind.SAMPLE, created)
            if created:
                tracing.submitted(rid)  # [trace hook] queue wait starts
        except NotLive as exc:  # refused as admission would have
            raise self.ctx.catalog.not_live(
                s.sampler_id, s.live_session or "", exc.state, sampler=True
            ) from exc
        except QueueFull as exc:
            raise OverCapacity("the sampling queue is full; retry later") from exc
        except ClaimConflict as exc:
            raise UserInputError(
                "seq_id", f"already used by request {exc} with a different payload"
            ) from exc
        finally:
            if not created:  # a retry of a queued sample, or refused: nothing runs as `new`
                self.decoded_samples.take(new)
        self.on_sample()
        return pb.SubmitReply(
            request_id=rid, sample_sequence_ids=[f"{rid}:seq:{i}" for i in range(s.num_samples)]
        )

    def max_tokens_per_datum(self) -> int:
        """The longest datum a forward_backward may hold: the context length, the
        --max-tokens-per-datum limit and the training engine's memory budget, whichever is
        least (what capabilities and get_info report)."""
        limits = (self.limits.max_tokens_per_datum, self.memory.max_row_tokens)
        return min([self.card.max_context_length, *(n for n in limits if n)])

    @staticmethod
    def _tenant_error(exc: TenantLimitReached) -> UserInputError:
        """The tenant quotas are checked atomically with the run's creation (Jobs.claim_training);
        a retried create_model (its run already exists) passes."""
        if exc.limit == "max_tenants_per_key":
            return UserInputError(
                "create_model",
                f"this API key already has {exc.count} "
                f"training runs, its quota (max_tenants_per_key or the keys file's "
                f"max_training_runs: {exc.most})",
            )
        return UserInputError(
            "create_model",
            f"this server already holds {exc.count} training "
            f"runs, its limit (max_tenants {exc.most})",
        )
