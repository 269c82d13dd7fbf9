"""JSON response bodies, shaped as the tinker SDK 0.38 validates them (tinker-protocol.md §2-3).

Literal `type` fields carry the exact value the SDK checks. Datetimes are timezone-aware (UTC)
and serialize as ISO 8601, e.g. "2026-11-22T02:49:33Z".
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from lockstep.vocab import RunStatus


class SchemaModel(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# ---------------------------------------------------------------- client and health
class ClientConfigResponse(SchemaModel):
    pjwt_auth_enabled: bool = False
    use_pyqwest_transport: bool = False
    proto_compress_fwdbwd: bool = False
    fwdbwd_max_chunk_len: int = 1024  # datums per fwd/bwd request the SDK sends
    fwdbwd_max_chunk_bytes_count: int = 5_000_000  # its estimated body bytes per request
    custom_loss_server_side: bool = False  # create_custom_loss uploads; losses run here
    sample_use_retrieve_futures: bool = False  # one retrieve_futures poller per sampling session
    sample_join_sampling_session: bool = False  # unpickled SamplingClients ask for a clone id


class ClientDynamicConfigResponse(SchemaModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False  # abandoned samples are cancelled (cancel_future)


class TelemetryResponse(SchemaModel):
    status: Literal["accepted"] = "accepted"


class HealthResponse(SchemaModel):
    status: Literal["ok", "unavailable"]
    parts: dict[str, str] = {}
    version: str  # this gateway's Lockstep version
    scheduler_version: str | None = None  # the scheduler's, when it answered
    state_format: int | None = None  # the state format the scheduler writes


class OrgDetails(SchemaModel):
    name: str


class UserDetails(SchemaModel):
    email: str


class ApiKeyDetails(SchemaModel):
    org_details: OrgDetails
    user_details: UserDetails


class ApiKeyMeResponse(SchemaModel):
    key_id: int
    name: str
    note: str
    details: ApiKeyDetails


# ---------------------------------------------------------------- sessions
class CreateSessionResponse(SchemaModel):
    type: Literal["create_session"] = "create_session"
    session_id: str


class SessionHeartbeatResponse(SchemaModel):
    type: Literal["session_heartbeat"] = "session_heartbeat"


class GetSessionResponse(SchemaModel):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class ListSessionsResponse(SchemaModel):
    sessions: list[str]


# ---------------------------------------------------------------- futures
class UntypedAPIFuture(SchemaModel):
    request_id: str
    model_id: str | None = None


class SampleFuture(SchemaModel):
    request_id: str
    sample_sequence_ids: list[str]


class TryAgainResponse(SchemaModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class RequestFailedResponse(SchemaModel):
    error: str
    category: Literal["user", "server", "unknown"]


class FutureFinished(SchemaModel):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: int


class FutureFailed(SchemaModel):
    state: Literal["failed"] = "failed"  # failed or cancelled; retrieve_future tells which
    request_id: str


class FuturesRetrieveResponse(SchemaModel):
    completions: list[FutureFinished | FutureFailed]
    cursor: int  # the SDK sends it back as prev_cursor


# cancelled: its future now answers a "cancelled" error (a queued sample never runs);
# already_finished / already_failed: it had an outcome, which stands.
CancelOutcome = Literal["cancelled", "already_finished", "already_failed"]


class CancelFutureResponse(SchemaModel):
    request_id: str
    outcome: CancelOutcome


class CreateModelResult(SchemaModel):
    type: Literal["create_model"] = "create_model"
    model_id: str


class CreateCustomLossResponse(SchemaModel):
    type: Literal["create_custom_loss"] = "create_custom_loss"
    loss_id: str


class UnloadModelResult(SchemaModel):
    type: Literal["unload_model"] = "unload_model"
    model_id: str


class OptimStepResult(SchemaModel):
    metrics: dict[str, float] | None = None


class SaveWeightsResult(SchemaModel):
    type: Literal["save_weights"] = "save_weights"
    path: str


class SaveWeightsForSamplerResult(SchemaModel):
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"
    path: str | None = None
    sampling_session_id: str | None = None


class SaveWeightsExternalResult(SchemaModel):
    type: Literal["save_weights_external"] = "save_weights_external"
    path: str
    size_bytes: int | None = None


class LoadWeightsResult(SchemaModel):
    type: Literal["load_weights"] = "load_weights"
    path: str | None = None
    model_id: str | None = None


# ---------------------------------------------------------------- models and samplers
class OptimizerConfig(SchemaModel):
    type: str = "adamw"


class ModelData(SchemaModel):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(SchemaModel):
    type: Literal["get_info"] = "get_info"
    model_id: str
    model_data: ModelData
    optimizer_config: OptimizerConfig = OptimizerConfig()
    is_lora: bool | None = None
    lora_rank: int | None = None
    model_name: str | None = None
    # Lockstep's own: the longest datum a forward_backward may hold (context length,
    # --max-tokens-per-datum and the trainer's memory budget, whichever is least), and what one
    # datum's custom loss may cost (FLOPs per token of the datum; bytes of temporaries).
    max_tokens_per_datum: int | None = None
    custom_loss_max_flops_per_token: int | None = None
    custom_loss_max_memory_bytes: int | None = None
    # Lockstep's own: "packed", or "generic" (a family outside the packed list: each row runs
    # alone through the model's own forward, exact but slower).
    trainer_path: str | None = None
    # Lockstep's own, hybrid models only: who computes each hybrid kernel in the trainer, e.g.
    # {"gated_delta_rule": "fla", "short_convolution": "fla"}; "reference" is PyTorch (slower).
    trainer_kernels: dict[str, str] | None = None


class CreateSamplingSessionResponse(SchemaModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class JoinSamplingSessionResponse(SchemaModel):
    type: Literal["join_sampling_session"] = "join_sampling_session"
    client_counter: int  # the joining client's clone id: its seq_ids start at it * 1e9


class GetSamplerResponse(SchemaModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class SupportedModel(SchemaModel):
    model_name: str | None = None
    max_context_length: int | None = None
    trainable: bool | None = None
    sampleable: bool | None = None
    # Lockstep's own (the SDK ignores fields it does not know): as GetInfoResponse's, and the
    # bytes one training pass may use.
    max_tokens_per_datum: int | None = None
    trainer_memory_budget_bytes: int | None = None
    custom_loss_max_flops_per_token: int | None = None
    custom_loss_max_memory_bytes: int | None = None
    trainer_path: str | None = None  # "packed", or "generic" (each row alone: slower)
    sampler_inputs: list[str] | None = None  # "text", "image": what a prompt may hold
    trainer_kernels: dict[str, str] | None = None  # as GetInfoResponse's (hybrid models only)
    sampler_kernels: dict[str, str] | None = None  # the local sampler's (transformers' choice)


class ServerCapabilitiesResponse(SchemaModel):
    supported_models: list[SupportedModel]
    # Lockstep's own (the SDK ignores fields it does not know): the scheduler's version and the
    # state format it writes.
    lockstep_version: str | None = None
    state_format: int | None = None


# ---------------------------------------------------------------- runs and checkpoints
class Checkpoint(SchemaModel):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler", "external"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(SchemaModel):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(SchemaModel):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(SchemaModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None
    # Lockstep's own (the SDK ignores them): progress as committed, and what it is doing.
    steps: int | None = None
    tokens_trained: int | None = None
    status: RunStatus | None = None
    queued: int | None = None


class StepMetrics(SchemaModel):
    """One optimizer step's metrics: its passes' joined (`:sum` added, `:mean` weighted by
    datums), forward-only passes' under `forward/`, the step's own under `optim_step/`."""

    step: int
    time: datetime
    metrics: dict[str, float]
    datums: int
    tokens: int
    complete: bool  # False: the newest passes, whose optim_step has not run yet
    steps: int = 1  # steps this point is the mean of (the route's `points`)


class RunHistoryResponse(SchemaModel):
    training_run_id: str
    steps: list[StepMetrics]
    first_step: int  # steps before it were trimmed from the history


class QueuedFuture(SchemaModel):
    request_id: str
    kind: str
    seq_id: int
    status: str


class RunFuturesResponse(SchemaModel):
    training_run_id: str
    futures: list[QueuedFuture]  # the first ones, in seq_id order
    total_count: int


class TrainingRunsResponse(SchemaModel):
    training_runs: list[TrainingRun]
    cursor: Cursor


class ExternalWeightsUrlsResponse(SchemaModel):
    urls: dict[str, str]
    expires: datetime


class WeightsInfoResponse(SchemaModel):
    base_model: str
    optimizer_config: OptimizerConfig = OptimizerConfig()
    is_lora: bool
    lora_rank: int | None = None
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None
