"""JSON request bodies sent by the tinker SDK 0.38 (unknown fields are ignored)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
NonNegInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
PosInt = Annotated[int, Field(ge=1, le=INT32_MAX)]
PosInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
FiniteNonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]


class WireModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---------------------------------------------------------------- sessions
class CreateSessionRequest(WireModel):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(WireModel):
    session_id: str


class FinishReason(WireModel):
    type: str = "success"


class FinishSessionRequest(WireModel):
    reason: FinishReason | None = None
    detail: str | None = None


# ---------------------------------------------------------------- model inputs
class EncodedTextChunk(WireModel):
    type: Literal["encoded_text"]
    tokens: list[int]


class ImageChunk(WireModel):
    type: Literal["image"]
    data: str  # base64
    format: str
    expected_tokens: NonNegInt | None = None


class ImageAssetPointerChunk(WireModel):
    type: Literal["image_asset_pointer"]
    format: str
    location: str
    expected_tokens: NonNegInt | None = None


class DmelChunk(WireModel):
    type: Literal["dmel"]
    dmel: str  # base64


Chunk = Annotated[
    EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk,
    Field(discriminator="type"),
]


class ModelInput(WireModel):
    chunks: list[Chunk]


class TensorData(WireModel):
    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


# ---------------------------------------------------------------- training
class LoraConfig(WireModel):
    rank: PosInt
    seed: Int64 | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(WireModel):
    """Family-tagged: {"type": "adamw"} or {"type": "dimuon", "version": 1}."""

    type: str = "adamw"


class UnloadModelRequest(WireModel):
    model_id: str


class CreateModelRequest(WireModel):
    session_id: str
    model_seq_id: NonNegInt
    base_model: Annotated[str, Field(min_length=1)]
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig | None = None


class GetInfoRequest(WireModel):
    model_id: str


class Datum(WireModel):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = {}


class ForwardBackwardInput(WireModel):
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardJsonRequest(WireModel):
    """JSON form of a fwd/bwd request (the SDK sends protobuf; accepted for robustness)."""

    model_id: str
    seq_id: int | None = None
    forward_backward_input: ForwardBackwardInput | None = None
    forward_input: ForwardBackwardInput | None = None  # forward-only


class OptimParams(WireModel):
    """AdamParams (`adam_params`) or a family-tagged `optimizer_params` / `optim_params`."""

    type: str | None = None
    learning_rate: FiniteNonNeg = 1e-4
    beta1: Beta = 0.9
    beta2: Beta = 0.95
    eps: FiniteNonNeg = 1e-12
    weight_decay: FiniteNonNeg = 0.0
    grad_clip_norm: Finite = 0.0


class OptimStepRequest(WireModel):
    model_id: str
    seq_id: int | None = None
    adam_params: OptimParams | None = None
    optimizer_params: OptimParams | None = None
    optim_params: OptimParams | None = None


class SaveWeightsRequest(WireModel):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    ttl_seconds: PosInt64 | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(WireModel):
    model_id: str
    path: str | None = None
    sampling_session_seq_id: NonNegInt | None = None
    kind: str = "snapshot"
    seq_id: int | None = None
    ttl_seconds: PosInt64 | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(WireModel):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: PosInt64 | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsRequest(WireModel):
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: NonNegInt | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class CustomLossInput(WireModel):
    name: str = Field(max_length=64)
    rank: Literal[0, 1, 2]


class CustomLossGraph(WireModel):
    """The SDK's traced loss as plain data; its nodes are checked by the scheduler."""

    format: Literal[1] = 1
    nodes: list[dict[str, Any]] = Field(max_length=4096)


class CreateCustomLossRequest(WireModel):
    session_id: str
    custom_loss_seq_id: NonNegInt
    name: str = Field(max_length=128)
    inputs: list[CustomLossInput] = Field(max_length=64)
    graph: CustomLossGraph


# ---------------------------------------------------------------- sampling
class CreateSamplingSessionRequest(WireModel):
    session_id: str
    sampling_session_seq_id: NonNegInt
    base_model: str | None = None
    model_path: str | None = None


class JoinSamplingSessionRequest(WireModel):
    sampling_session_id: str


class SamplingParams(WireModel):
    max_tokens: PosInt | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: FiniteNonNeg = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0


class SampleRequest(WireModel):
    num_samples: PosInt = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: Annotated[int, Field(ge=0, le=INT64_MAX)] | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: NonNegInt = 0
    topk_sample_logprobs: NonNegInt = 0
    target_prompt_logprobs: TensorData | None = None
    prompt_alt_tokens_k: NonNegInt = 0
    prompt_logprobs_last_n: PosInt | None = None
    record_stability_info: bool | None = None


# ---------------------------------------------------------------- futures and REST
class FutureRetrieveRequest(WireModel):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionFuturesTarget(WireModel):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: Annotated[int, Field(ge=0, le=INT64_MAX // 1_000_000_000)] = 0


class FuturesRetrieveRequest(WireModel):
    target: SamplingSessionFuturesTarget
    prev_cursor: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    timeout: FiniteNonNeg | None = None  # None: the server's long-poll; 0: answer at once
    # Results the client fetched. Kept anyway: a re-poll after a transport error finds them.
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(WireModel):
    request_id: str


class WeightsInfoRequest(WireModel):
    tinker_path: str


class CheckpointTtlRequest(WireModel):
    ttl_seconds: PosInt64 | None = None
