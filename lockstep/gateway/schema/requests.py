"""JSON request bodies sent by the tinker SDK 0.38 (unknown fields are ignored).

The types bound what the contract can carry (an int32 field takes an int32), not what a value
may be: that is each op's rule, judged by the scheduler (`scheduler/ops/`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
NonNegInt = Annotated[int, Field(ge=0, le=INT32_MAX)]
PosInt = Annotated[int, Field(ge=1, le=INT32_MAX)]
PosInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
Int64 = Annotated[int, Field(ge=-INT64_MAX - 1, le=INT64_MAX)]
FiniteNonNeg = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(allow_inf_nan=False)]
Beta = Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)]


class SchemaModel(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---------------------------------------------------------------- sessions
class CreateSessionRequest(SchemaModel):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(SchemaModel):
    session_id: str


class FinishReason(SchemaModel):
    type: str = "success"


class FinishSessionRequest(SchemaModel):
    reason: FinishReason | None = None
    detail: str | None = None


# ---------------------------------------------------------------- model inputs
class EncodedTextChunk(SchemaModel):
    type: Literal["encoded_text"]
    tokens: list[int]


class ImageChunk(SchemaModel):
    type: Literal["image"]
    data: str  # base64
    format: str
    expected_tokens: NonNegInt | None = None


class ImageAssetPointerChunk(SchemaModel):
    type: Literal["image_asset_pointer"]
    format: str
    location: str
    expected_tokens: NonNegInt | None = None


class DmelChunk(SchemaModel):
    type: Literal["dmel"]
    dmel: str  # base64


Chunk = Annotated[
    EncodedTextChunk | ImageChunk | ImageAssetPointerChunk | DmelChunk,
    Field(discriminator="type"),
]


class ModelInput(SchemaModel):
    chunks: list[Chunk]


class TensorData(SchemaModel):
    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


# ---------------------------------------------------------------- training
class OptimizerConfig(SchemaModel):
    """Family-tagged: {"type": "adamw"} or {"type": "dimuon", "version": 1}."""

    type: str = "adamw"


class UnloadModelRequest(SchemaModel):
    model_id: str


class GetInfoRequest(SchemaModel):
    model_id: str


class Datum(SchemaModel):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = {}


class ForwardBackwardInput(SchemaModel):
    data: list[Datum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class ForwardBackwardJsonRequest(SchemaModel):
    """JSON form of a fwd/bwd request (the SDK sends protobuf; accepted for robustness)."""

    model_id: str
    seq_id: int | None = None
    forward_backward_input: ForwardBackwardInput | None = None
    forward_input: ForwardBackwardInput | None = None  # forward-only


class CustomLossInput(SchemaModel):
    name: str = Field(max_length=64)
    rank: Literal[0, 1, 2]


class CustomLossGraph(SchemaModel):
    """The SDK's traced loss as plain data; its nodes are checked by the scheduler."""

    format: Literal[1] = 1
    nodes: list[dict[str, Any]] = Field(max_length=4096)


class CreateCustomLossRequest(SchemaModel):
    session_id: str
    custom_loss_seq_id: NonNegInt
    name: str = Field(max_length=128)
    inputs: list[CustomLossInput] = Field(max_length=64)
    graph: CustomLossGraph


# ---------------------------------------------------------------- sampling
class CreateSamplingSessionRequest(SchemaModel):
    session_id: str
    sampling_session_seq_id: Int32
    base_model: str | None = None
    model_path: str | None = None


class JoinSamplingSessionRequest(SchemaModel):
    sampling_session_id: str


# ---------------------------------------------------------------- futures and REST
class FutureRetrieveRequest(SchemaModel):
    request_id: str
    allow_metadata_only: bool = False


class SamplingSessionFuturesTarget(SchemaModel):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str
    cloned_sampler_id: Annotated[int, Field(ge=0, le=INT64_MAX // 1_000_000_000)] = 0


class FuturesRetrieveRequest(SchemaModel):
    target: SamplingSessionFuturesTarget
    prev_cursor: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    timeout: FiniteNonNeg | None = None  # None: the server's long-poll; 0: answer at once
    # Results the client fetched. Kept anyway: a re-poll after a transport error finds them.
    retrieved_request_ids: list[str] = []


class CancelFutureRequest(SchemaModel):
    request_id: str


class WeightsInfoRequest(SchemaModel):
    tinker_path: str


class CheckpointTtlRequest(SchemaModel):
    ttl_seconds: PosInt64 | None = None
