"""Submit: validate a request against the scheduler's state and enqueue it exactly once.

Everything that can be rejected is rejected here, before it is queued, so a bad request gets a
400 naming its field and never reaches the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

from lockstep.config import Limits
from lockstep.engine import losses, memory
from lockstep.engine.types import NO_MEMORY_LIMIT, MemoryBudget, ModelCard, PassRequest
from lockstep.errors import UserInputError
from lockstep.observability import metrics
from lockstep.paths import TinkerPath, checkpoint_dir, validate_name
from lockstep.scheduler import encryption, tracing, translate
from lockstep.scheduler.catalog import Catalog, NotFound, OverCapacity
from lockstep.scheduler.claims import ClaimConflict, QueueFull, TenantLimitReached, TrainingClaim
from lockstep.scheduler.custom_losses import CustomLosses
from lockstep.scheduler.decoded import DecodedPasses
from lockstep.scheduler.records import LoraRecord, ModelRecord
from lockstep.scheduler.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind
from lockstep.wire.v1 import tinker_pb2 as wire


class Claim(NamedTuple):
    """What a training submission queues."""

    model_id: str
    seq_id: int
    kind: str
    tokens: int  # pass tokens (the cycle's token budget)
    new_model: ModelRecord | None = None
    decoded: PassRequest | None = None  # the validated pass, kept for dispatch


# Every limit is in lockstep.config.Limits. Admission: past the backlog limits a submission is
# told to come back later (HTTP 429, retried by the SDK with backoff) instead of growing the
# queue without bound; the size and tenant limits are permanent (400, naming the limit).


def _finite(value: float, field: str, minimum: float | None = None) -> None:
    if not math.isfinite(value):
        raise UserInputError(field, f"must be a finite number, got {value}")
    if minimum is not None and value < minimum:
        raise UserInputError(field, f"must be >= {minimum}, got {value}")


def retry_identity(req: pb.SubmitRequest) -> bytes | None:
    """What a retry of `req` must repeat to count as the same request (None: its payload).

    The SDK retries an ephemeral save_weights_for_sampler (save_weights_and_get_sampling_client)
    under the same seq_id but with the next sampling_session_seq_id from its counter; it is the
    same request, and the first one's sampler is the one the SDK is told about.
    """
    if req.WhichOneof("op") == "save_weights" and req.save_weights.HasField(
        "sampling_session_seq_id"
    ):
        same = pb.SubmitRequest()
        same.CopyFrom(req)
        same.save_weights.ClearField("sampling_session_seq_id")
        return bytes(same.SerializeToString(deterministic=True))
    return None


class Submissions:
    def __init__(
        self,
        store: Store,
        catalog: Catalog,
        card: ModelCard,
        data_dir: Path,
        on_training: Callable[[], None],
        on_sample: Callable[[], None],
        limits: Limits | None = None,
        memory_budget: MemoryBudget = NO_MEMORY_LIMIT,
        decoded: DecodedPasses | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.store = store
        self.catalog = catalog
        self.card = card
        self.memory = memory_budget  # the training engine's (TrainingEngine.memory_budget)
        self.data_dir = data_dir
        self.on_training = on_training
        self.on_sample = on_sample
        self.custom_losses = CustomLosses(store, catalog)
        self.decoded = decoded or DecodedPasses()  # shared with the dispatcher

    async def submit(self, req: pb.SubmitRequest) -> pb.SubmitReply:
        payload = req.SerializeToString(deterministic=True)
        op = req.WhichOneof("op")
        try:
            if op == "sample":
                return await self._sample(req, payload)
            if op == "refused":  # the gateway refused it: hold its seq_id, nothing else
                await self._hold_seq(req, payload, req.refused.reason)
                return pb.SubmitReply()
            try:
                queued = await self._training(req, op)
            except (UserInputError, NotFound) as exc:  # e.g. a missing checkpoint to load
                await self._hold_seq(req, payload, str(exc))
                raise
            model_id, kind = queued.model_id, queued.kind
            claim = TrainingClaim(
                owner=req.owner,
                model_id=model_id,
                seq_id=queued.seq_id,
                kind=OpKind(kind),
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
            )
            try:
                rid, created = await self.store.claim_training(claim)
            except QueueFull as exc:
                raise OverCapacity(
                    f"model {model_id} has {exc.queued} requests queued; retry later"
                ) from exc
            metrics.submitted(req.owner, model_id, kind, created)
            if created:
                tracing.submitted(rid)  # [trace hook] queue wait starts
                if queued.decoded is not None:
                    self.decoded.keep(rid, queued.decoded)
        except TenantLimitReached as exc:
            raise self._tenant_error(exc) from exc
        except ClaimConflict as exc:
            raise UserInputError(
                "seq_id",
                f"this seq_id was already used by request {exc} with a different "
                "payload; seq_ids must not be reused",
            ) from exc
        self.on_training()
        return pb.SubmitReply(request_id=rid, model_id=model_id)

    @staticmethod
    def _addressed(req: pb.SubmitRequest) -> tuple[str, int]:
        """(model_id, seq_id) of a request that takes a place in a model's sequence; ("", 0)
        for one that does not (create_model, create-via-load, sample)."""
        op = req.WhichOneof("op")
        if op not in ("forward_backward", "optim_step", "save_weights", "load_weights", "refused"):
            return "", 0
        addressed = getattr(req, op)
        return addressed.model_id, addressed.seq_id

    async def _hold_seq(self, req: pb.SubmitRequest, payload: bytes, reason: str) -> None:
        """The one rule for a refused request, whoever refused it: it still uses its seq_id (the
        SDK has moved on to the next one), as a failed request, if the caller owns the model
        and the seq_id is not already taken. Anyone else's request holds nothing."""
        model_id, seq_id = self._addressed(req)
        if not model_id or seq_id < 1:
            return
        model = await self.store.model(model_id)
        if model is None or model.owner != req.owner:
            return
        try:
            await self.store.claim_training(
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
        except ClaimConflict:
            return  # the seq_id already belongs to another request
        self.on_training()

    async def _training(self, req: pb.SubmitRequest, op: str | None) -> Claim:
        """Validate a training op and say what to queue; one handler per op kind."""
        owner = req.owner
        handlers: dict[str, Callable[[], Awaitable[Claim]]] = {
            "create_model": lambda: self._create_model(owner, req.create_model),
            "forward_backward": lambda: self._forward_backward(owner, req.forward_backward),
            "optim_step": lambda: self._optim_step(owner, req.optim_step),
            "save_weights": lambda: self._save_weights(owner, req.save_weights),
            "load_weights": lambda: self._load(owner, req.load_weights),
        }
        handler = handlers.get(op or "")
        if handler is None:
            raise UserInputError("type", f"unknown operation {op!r}")
        return await handler()

    async def _create_model(self, owner: str, c: pb.CreateModel) -> Claim:
        session = await self.catalog.live_session(owner, c.session_id)
        self.catalog.resolve_base_model(c.base_model)
        lc = c.lora_config
        if not 1 <= lc.rank <= self.limits.max_lora_rank:
            raise UserInputError("lora_config.rank", f"must be in [1, {self.limits.max_lora_rank}]")
        if not (lc.train_attn or lc.train_mlp or lc.train_unembed):
            raise UserInputError("lora_config", "at least one of train_* must be true")
        if c.optimizer_type not in ("", "adamw"):
            raise UserInputError(
                "optimizer_config.type", f"{c.optimizer_type!r} is not supported; use adamw"
            )
        model_id = f"{session.session_id}:train:{c.model_seq_id}"
        now = time.time()
        record = ModelRecord(
            model_id=model_id,
            owner=owner,
            session_id=session.session_id,
            base_model=c.base_model,
            lora=LoraRecord(
                rank=lc.rank,
                seed=lc.seed if lc.HasField("seed") else None,
                train_attn=lc.train_attn,
                train_mlp=lc.train_mlp,
                train_unembed=lc.train_unembed,
            ),
            created=now,
            last_request_time=now,
            user_metadata=dict(c.user_metadata),
        )
        return Claim(model_id, 0, "create_model", 0, record)

    async def _forward_backward(self, owner: str, fb: wire.ForwardBackwardRequest) -> Claim:
        model = await self._owned_model(owner, fb.model_id)
        self._check_seq(fb.seq_id)
        if not fb.data:
            raise UserInputError("data", "no datums given")
        self._check_sizes(fb)
        pass_req = translate.pass_request("", fb)  # its request id once claimed
        pass_req.custom_loss = await self.custom_losses.named(model, pass_req)
        losses.validate_pass_request(pass_req, self.card.vocab_size, self.card.max_context_length)
        await self.custom_losses.check_sizes(pass_req)
        kind = "forward" if fb.forward_only else "forward_backward"
        return Claim(fb.model_id, fb.seq_id, kind, translate.pass_tokens(fb), decoded=pass_req)

    async def _optim_step(self, owner: str, o: pb.OptimStep) -> Claim:
        await self._owned_model(owner, o.model_id)
        self._check_seq(o.seq_id)
        a = o.adam
        _finite(a.learning_rate, "adam_params.learning_rate", 0.0)
        _finite(a.weight_decay, "adam_params.weight_decay", 0.0)
        _finite(a.grad_clip_norm, "adam_params.grad_clip_norm")
        _finite(a.eps, "adam_params.eps", 0.0)
        for name, beta in (("beta1", a.beta1), ("beta2", a.beta2)):
            _finite(beta, f"adam_params.{name}", 0.0)
            if beta >= 1.0:
                raise UserInputError(f"adam_params.{name}", f"must be < 1, got {beta}")
        return Claim(o.model_id, o.seq_id, "optim_step", 0)

    async def _save_weights(self, owner: str, s: pb.SaveWeights) -> Claim:
        await self._owned_model(owner, s.model_id)
        self._check_seq(s.seq_id)
        if s.HasField("name"):
            validate_name(s.name)
            if s.HasField("ttl_seconds") and s.ttl_seconds <= 0:
                raise UserInputError("ttl_seconds", "must be positive")
        if s.age_recipients:
            if s.kind != pb.CHECKPOINT_KIND_EXTERNAL:
                raise UserInputError(encryption.FIELD, "only save_weights_external encrypts")
            encryption.parse_recipients(list(s.age_recipients))
        return Claim(s.model_id, s.seq_id, "save", 0)

    async def _load(self, owner: str, load: pb.LoadWeights) -> Claim:
        path = TinkerPath.parse(load.path)
        if path.segment != "weights":
            raise UserInputError(
                "path", "load_state needs a training checkpoint (tinker://<run>/weights/<name>)"
            )
        await self.catalog.readable_checkpoint(owner, path)
        if not checkpoint_dir(self.data_dir, path).is_dir():
            raise NotFound(f"checkpoint {path} has no files on this server")
        if load.HasField("model_id"):  # load_state on an existing model, in its seq order
            await self._owned_model(owner, load.model_id)
            self._check_seq(load.seq_id)
            return Claim(load.model_id, load.seq_id, "load", 0)
        # create-via-load: a new model whose id the SDK computes itself
        session = await self.catalog.live_session(owner, load.session_id)
        source = await self.store.model(path.model_id)
        if source is None:
            raise NotFound(f"training run {path.model_id} does not exist")
        model_id = f"{session.session_id}:train:{load.model_seq_id}"
        now = time.time()
        record = ModelRecord(
            model_id=model_id,
            owner=owner,
            session_id=session.session_id,
            base_model=load.base_model if load.HasField("base_model") else source.base_model,
            lora=source.lora,
            created=now,
            last_request_time=now,
            user_metadata=dict(load.user_metadata),
        )
        return Claim(model_id, 0, "load", 0, record)

    async def _sample(self, req: pb.SubmitRequest, payload: bytes) -> pb.SubmitReply:
        s = req.sample
        sampler = await self.catalog.owned_sampler(req.owner, s.sampling_session_id)
        await self.catalog.live_session(req.owner, sampler.session_id, "sampling_session_id")
        if not s.prompt_tokens:
            raise UserInputError("prompt", "is empty")
        if not 1 <= s.num_samples <= self.limits.max_samples_per_request:
            raise UserInputError(
                "num_samples", f"must be in [1, {self.limits.max_samples_per_request}]"
            )
        per_datum = self.limits.max_tokens_per_datum
        if per_datum and len(s.prompt_tokens) > per_datum:
            raise UserInputError(
                "prompt",
                f"has {len(s.prompt_tokens)} tokens; this server "
                f"accepts at most {per_datum} (max_tokens_per_datum)",
            )
        vocab = self.card.vocab_size
        for i, tok in enumerate(s.prompt_tokens):
            if not 0 <= tok < vocab:
                raise UserInputError(
                    f"prompt.tokens[{i}]", f"token id {tok} is outside [0, {vocab})"
                )
        max_tokens = s.params.max_tokens if s.params.HasField("max_tokens") else 16
        if max_tokens < 1:
            raise UserInputError("sampling_params.max_tokens", "must be >= 1")
        if len(s.prompt_tokens) + max_tokens > self.card.max_context_length:
            raise UserInputError(
                "sampling_params.max_tokens",
                f"prompt ({len(s.prompt_tokens)}) + max_tokens ({max_tokens}) exceeds the "
                f"context length {self.card.max_context_length}",
            )
        for name, value in (("temperature", s.params.temperature), ("top_p", s.params.top_p)):
            _finite(value, f"sampling_params.{name}", 0.0)
        try:
            rid, created = await self.store.claim_sample(
                owner=req.owner,
                sampler_id=s.sampling_session_id,
                seq_id=s.seq_id,
                payload=payload,
                backlog=self.limits.max_pending_samples,
            )
            metrics.submitted(req.owner, s.sampling_session_id, "sample", created)
            if created:
                tracing.submitted(rid)  # [trace hook] queue wait starts
        except QueueFull as exc:
            raise OverCapacity("the sampling queue is full; retry later") from exc
        except ClaimConflict as exc:
            raise UserInputError(
                "seq_id", f"already used by request {exc} with a different payload"
            ) from exc
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

    def _check_sizes(self, fb: wire.ForwardBackwardRequest) -> None:
        """The request-size limits: datums per request, model-input tokens per datum, and the
        admission rule: a datum whose pass the training engine's memory cannot hold."""
        most = self.limits.max_datums_per_request
        if len(fb.data) > most:
            raise UserInputError(
                "data",
                f"has {len(fb.data)} datums; this server accepts at "
                f"most {most} per request (max_datums_per_request)",
            )
        per_datum, fits = self.limits.max_tokens_per_datum, self.memory.max_row_tokens
        for i, datum in enumerate(fb.data):
            n = sum(len(c.encoded_text.tokens) // 4 for c in datum.model_input)
            if per_datum and n > per_datum:
                raise UserInputError(
                    f"data[{i}].model_input",
                    f"has {n} tokens; this server "
                    f"accepts at most {per_datum} (max_tokens_per_datum)",
                )
            if fits and fits < n <= self.card.max_context_length:  # longer: the context rule
                raise UserInputError(
                    f"data[{i}].model_input",
                    f"has {n} tokens; a training pass fits rows of at most {fits} tokens in "
                    f"the training engine's memory budget of {memory.describe(self.memory)}",
                )

    @staticmethod
    def _tenant_error(exc: TenantLimitReached) -> UserInputError:
        """The tenant quotas are checked atomically with the run's creation (Store.claim_training);
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

    async def _owned_model(self, owner: str, model_id: str) -> ModelRecord:
        return await self.catalog.live_model(owner, model_id)  # tenancy: session ended?

    @staticmethod
    def _check_seq(seq_id: int) -> None:
        if seq_id < 1:
            raise UserInputError("seq_id", f"must be >= 1, got {seq_id}")
