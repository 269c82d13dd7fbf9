from lockstep.wire.v1 import tinker_pb2 as _tinker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKPOINT_KIND_UNSPECIFIED: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_TRAINING: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_SAMPLER: _ClassVar[CheckpointKind]
    CHECKPOINT_KIND_EXTERNAL: _ClassVar[CheckpointKind]

class SamplerKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLER_KIND_SNAPSHOT: _ClassVar[SamplerKind]
    SAMPLER_KIND_INFLIGHT: _ClassVar[SamplerKind]

class CancelOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CANCEL_OUTCOME_UNSPECIFIED: _ClassVar[CancelOutcome]
    CANCEL_OUTCOME_CANCELLED: _ClassVar[CancelOutcome]
    CANCEL_OUTCOME_ALREADY_FINISHED: _ClassVar[CancelOutcome]
    CANCEL_OUTCOME_ALREADY_FAILED: _ClassVar[CancelOutcome]
CHECKPOINT_KIND_UNSPECIFIED: CheckpointKind
CHECKPOINT_KIND_TRAINING: CheckpointKind
CHECKPOINT_KIND_SAMPLER: CheckpointKind
CHECKPOINT_KIND_EXTERNAL: CheckpointKind
SAMPLER_KIND_SNAPSHOT: SamplerKind
SAMPLER_KIND_INFLIGHT: SamplerKind
CANCEL_OUTCOME_UNSPECIFIED: CancelOutcome
CANCEL_OUTCOME_CANCELLED: CancelOutcome
CANCEL_OUTCOME_ALREADY_FINISHED: CancelOutcome
CANCEL_OUTCOME_ALREADY_FAILED: CancelOutcome

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("owner", "tags", "user_metadata", "sdk_version", "project_id", "display_name")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SDK_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    owner: str
    tags: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    sdk_version: str
    project_id: str
    display_name: str
    def __init__(self, owner: _Optional[str] = ..., tags: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., sdk_version: _Optional[str] = ..., project_id: _Optional[str] = ..., display_name: _Optional[str] = ...) -> None: ...

class CreateSessionReply(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("owner", "session_id")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_id: str
    def __init__(self, owner: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("finished",)
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    finished: bool
    def __init__(self, finished: bool = ...) -> None: ...

class SessionTrace(_message.Message):
    __slots__ = ("trace_json",)
    TRACE_JSON_FIELD_NUMBER: _ClassVar[int]
    trace_json: bytes
    def __init__(self, trace_json: _Optional[bytes] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("training_run_ids", "sampler_ids", "user_metadata", "display_name")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAINING_RUN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    training_run_ids: _containers.RepeatedScalarFieldContainer[str]
    sampler_ids: _containers.RepeatedScalarFieldContainer[str]
    user_metadata: _containers.ScalarMap[str, str]
    display_name: str
    def __init__(self, training_run_ids: _Optional[_Iterable[str]] = ..., sampler_ids: _Optional[_Iterable[str]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., display_name: _Optional[str] = ...) -> None: ...

class CustomLossInput(_message.Message):
    __slots__ = ("name", "rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ...) -> None: ...

class CreateCustomLossRequest(_message.Message):
    __slots__ = ("owner", "session_id", "custom_loss_seq_id", "name", "inputs", "graph_json")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_JSON_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_id: str
    custom_loss_seq_id: int
    name: str
    inputs: _containers.RepeatedCompositeFieldContainer[CustomLossInput]
    graph_json: bytes
    def __init__(self, owner: _Optional[str] = ..., session_id: _Optional[str] = ..., custom_loss_seq_id: _Optional[int] = ..., name: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[CustomLossInput, _Mapping]]] = ..., graph_json: _Optional[bytes] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("owner", "limit", "offset", "all_owners")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALL_OWNERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    limit: int
    offset: int
    all_owners: bool
    def __init__(self, owner: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ..., all_owners: bool = ...) -> None: ...

class SessionList(_message.Message):
    __slots__ = ("session_ids", "total_count")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    total_count: int
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., total_count: _Optional[int] = ...) -> None: ...

class LoraConfig(_message.Message):
    __slots__ = ("rank", "seed", "train_unembed", "train_mlp", "train_attn")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    seed: int
    train_unembed: bool
    train_mlp: bool
    train_attn: bool
    def __init__(self, rank: _Optional[int] = ..., seed: _Optional[int] = ..., train_unembed: bool = ..., train_mlp: bool = ..., train_attn: bool = ...) -> None: ...

class CreateModel(_message.Message):
    __slots__ = ("session_id", "model_seq_id", "base_model", "lora_config", "user_metadata", "optimizer_type")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_TYPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfig
    user_metadata: _containers.ScalarMap[str, str]
    optimizer_type: str
    def __init__(self, session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., base_model: _Optional[str] = ..., lora_config: _Optional[_Union[LoraConfig, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., optimizer_type: _Optional[str] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class OptimStep(_message.Message):
    __slots__ = ("model_id", "seq_id", "adam")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    adam: AdamParams
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class SaveWeights(_message.Message):
    __slots__ = ("model_id", "seq_id", "kind", "name", "ttl_seconds", "overwrite", "user_metadata", "sampling_session_seq_id", "age_recipients", "sampler_kind")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    AGE_RECIPIENTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_KIND_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    kind: CheckpointKind
    name: str
    ttl_seconds: int
    overwrite: bool
    user_metadata: _containers.ScalarMap[str, str]
    sampling_session_seq_id: int
    age_recipients: _containers.RepeatedScalarFieldContainer[str]
    sampler_kind: SamplerKind
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., kind: _Optional[_Union[CheckpointKind, str]] = ..., name: _Optional[str] = ..., ttl_seconds: _Optional[int] = ..., overwrite: bool = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., sampling_session_seq_id: _Optional[int] = ..., age_recipients: _Optional[_Iterable[str]] = ..., sampler_kind: _Optional[_Union[SamplerKind, str]] = ...) -> None: ...

class LoadWeights(_message.Message):
    __slots__ = ("model_id", "seq_id", "session_id", "model_seq_id", "path", "optimizer", "user_metadata", "base_model")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    session_id: str
    model_seq_id: int
    path: str
    optimizer: bool
    user_metadata: _containers.ScalarMap[str, str]
    base_model: str
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., path: _Optional[str] = ..., optimizer: bool = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., base_model: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "seed", "temperature", "top_k", "top_p", "has_stop", "stop_strings", "stop_tokens")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    HAS_STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    has_stop: bool
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    stop_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., has_stop: bool = ..., stop_strings: _Optional[_Iterable[str]] = ..., stop_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sampling_session_id", "seq_id", "prompt_tokens", "num_samples", "params", "prompt_logprobs", "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_logprobs_last_n", "prompt_chunks")
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOPK_SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    sampling_session_id: str
    seq_id: int
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    topk_prompt_logprobs: int
    topk_sample_logprobs: int
    prompt_logprobs_last_n: int
    prompt_chunks: _containers.RepeatedCompositeFieldContainer[_tinker_pb2.Chunk]
    def __init__(self, sampling_session_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_logprobs: bool = ..., topk_prompt_logprobs: _Optional[int] = ..., topk_sample_logprobs: _Optional[int] = ..., prompt_logprobs_last_n: _Optional[int] = ..., prompt_chunks: _Optional[_Iterable[_Union[_tinker_pb2.Chunk, _Mapping]]] = ...) -> None: ...

class Refused(_message.Message):
    __slots__ = ("model_id", "seq_id", "reason")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    seq_id: int
    reason: str
    def __init__(self, model_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("owner", "key_max_training_runs", "create_model", "forward_backward", "optim_step", "save_weights", "load_weights", "sample", "refused")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    KEY_MAX_TRAINING_RUNS_FIELD_NUMBER: _ClassVar[int]
    CREATE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    owner: str
    key_max_training_runs: int
    create_model: CreateModel
    forward_backward: _tinker_pb2.ForwardBackwardRequest
    optim_step: OptimStep
    save_weights: SaveWeights
    load_weights: LoadWeights
    sample: Sample
    refused: Refused
    def __init__(self, owner: _Optional[str] = ..., key_max_training_runs: _Optional[int] = ..., create_model: _Optional[_Union[CreateModel, _Mapping]] = ..., forward_backward: _Optional[_Union[_tinker_pb2.ForwardBackwardRequest, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStep, _Mapping]] = ..., save_weights: _Optional[_Union[SaveWeights, _Mapping]] = ..., load_weights: _Optional[_Union[LoadWeights, _Mapping]] = ..., sample: _Optional[_Union[Sample, _Mapping]] = ..., refused: _Optional[_Union[Refused, _Mapping]] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("request_id", "model_id", "sample_sequence_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_id: str
    sample_sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., model_id: _Optional[str] = ..., sample_sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RetrieveFutureRequest(_message.Message):
    __slots__ = ("owner", "request_id", "timeout_seconds")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    request_id: str
    timeout_seconds: float
    def __init__(self, owner: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class CreateModelResult(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class OptimStepResult(_message.Message):
    __slots__ = ("metrics",)
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SaveResult(_message.Message):
    __slots__ = ("path", "sampling_session_id", "size_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    sampling_session_id: str
    size_bytes: int
    def __init__(self, path: _Optional[str] = ..., sampling_session_id: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UnloadModelResult(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class CustomLossResult(_message.Message):
    __slots__ = ("loss_id",)
    LOSS_ID_FIELD_NUMBER: _ClassVar[int]
    loss_id: str
    def __init__(self, loss_id: _Optional[str] = ...) -> None: ...

class LoadResult(_message.Message):
    __slots__ = ("model_id", "path")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    path: str
    def __init__(self, model_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class JobResult(_message.Message):
    __slots__ = ("create_model", "forward_backward", "optim_step", "save", "load", "sample", "unload_model", "custom_loss")
    CREATE_MODEL_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_MODEL_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_FIELD_NUMBER: _ClassVar[int]
    create_model: CreateModelResult
    forward_backward: _tinker_pb2.ForwardBackwardOutput
    optim_step: OptimStepResult
    save: SaveResult
    load: LoadResult
    sample: _tinker_pb2.SampleResponse
    unload_model: UnloadModelResult
    custom_loss: CustomLossResult
    def __init__(self, create_model: _Optional[_Union[CreateModelResult, _Mapping]] = ..., forward_backward: _Optional[_Union[_tinker_pb2.ForwardBackwardOutput, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStepResult, _Mapping]] = ..., save: _Optional[_Union[SaveResult, _Mapping]] = ..., load: _Optional[_Union[LoadResult, _Mapping]] = ..., sample: _Optional[_Union[_tinker_pb2.SampleResponse, _Mapping]] = ..., unload_model: _Optional[_Union[UnloadModelResult, _Mapping]] = ..., custom_loss: _Optional[_Union[CustomLossResult, _Mapping]] = ...) -> None: ...

class JobError(_message.Message):
    __slots__ = ("message", "category")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CATEGORY_FIELD_NUMBER: _ClassVar[int]
    message: str
    category: str
    def __init__(self, message: _Optional[str] = ..., category: _Optional[str] = ...) -> None: ...

class TryAgain(_message.Message):
    __slots__ = ("queue_state", "reason")
    QUEUE_STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    queue_state: str
    reason: str
    def __init__(self, queue_state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class FutureReply(_message.Message):
    __slots__ = ("try_again", "result", "error")
    TRY_AGAIN_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    try_again: TryAgain
    result: JobResult
    error: JobError
    def __init__(self, try_again: _Optional[_Union[TryAgain, _Mapping]] = ..., result: _Optional[_Union[JobResult, _Mapping]] = ..., error: _Optional[_Union[JobError, _Mapping]] = ...) -> None: ...

class RetrieveFuturesRequest(_message.Message):
    __slots__ = ("owner", "sampler_id", "clone", "prev_cursor", "timeout_seconds")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    CLONE_FIELD_NUMBER: _ClassVar[int]
    PREV_CURSOR_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    sampler_id: str
    clone: int
    prev_cursor: int
    timeout_seconds: float
    def __init__(self, owner: _Optional[str] = ..., sampler_id: _Optional[str] = ..., clone: _Optional[int] = ..., prev_cursor: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class FutureCompletion(_message.Message):
    __slots__ = ("request_id", "failed", "payload_size", "answer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failed: bool
    payload_size: int
    answer: FutureReply
    def __init__(self, request_id: _Optional[str] = ..., failed: bool = ..., payload_size: _Optional[int] = ..., answer: _Optional[_Union[FutureReply, _Mapping]] = ...) -> None: ...

class RetrieveFuturesReply(_message.Message):
    __slots__ = ("completions", "cursor")
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[FutureCompletion]
    cursor: int
    def __init__(self, completions: _Optional[_Iterable[_Union[FutureCompletion, _Mapping]]] = ..., cursor: _Optional[int] = ...) -> None: ...

class CancelFutureRequest(_message.Message):
    __slots__ = ("owner", "request_id")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    request_id: str
    def __init__(self, owner: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class CancelFutureReply(_message.Message):
    __slots__ = ("outcome",)
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    outcome: CancelOutcome
    def __init__(self, outcome: _Optional[_Union[CancelOutcome, str]] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("owner", "model_id")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    model_id: str
    def __init__(self, owner: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "base_model", "arch", "tokenizer_id", "lora_rank", "lora_config", "max_tokens_per_datum", "custom_loss_max_flops_per_token", "custom_loss_max_memory_bytes", "trainer_path", "trainer_kernels")
    class TrainerKernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_DATUM_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_MAX_FLOPS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    TRAINER_KERNELS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    base_model: str
    arch: str
    tokenizer_id: str
    lora_rank: int
    lora_config: LoraConfig
    max_tokens_per_datum: int
    custom_loss_max_flops_per_token: int
    custom_loss_max_memory_bytes: int
    trainer_path: str
    trainer_kernels: _containers.ScalarMap[str, str]
    def __init__(self, model_id: _Optional[str] = ..., base_model: _Optional[str] = ..., arch: _Optional[str] = ..., tokenizer_id: _Optional[str] = ..., lora_rank: _Optional[int] = ..., lora_config: _Optional[_Union[LoraConfig, _Mapping]] = ..., max_tokens_per_datum: _Optional[int] = ..., custom_loss_max_flops_per_token: _Optional[int] = ..., custom_loss_max_memory_bytes: _Optional[int] = ..., trainer_path: _Optional[str] = ..., trainer_kernels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateSamplingSessionRequest(_message.Message):
    __slots__ = ("owner", "session_id", "sampling_session_seq_id", "model_path", "base_model")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SESSION_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_id: str
    sampling_session_seq_id: int
    model_path: str
    base_model: str
    def __init__(self, owner: _Optional[str] = ..., session_id: _Optional[str] = ..., sampling_session_seq_id: _Optional[int] = ..., model_path: _Optional[str] = ..., base_model: _Optional[str] = ...) -> None: ...

class SamplerRef(_message.Message):
    __slots__ = ("owner", "sampler_id")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    sampler_id: str
    def __init__(self, owner: _Optional[str] = ..., sampler_id: _Optional[str] = ...) -> None: ...

class JoinSamplingSessionReply(_message.Message):
    __slots__ = ("client_counter",)
    CLIENT_COUNTER_FIELD_NUMBER: _ClassVar[int]
    client_counter: int
    def __init__(self, client_counter: _Optional[int] = ...) -> None: ...

class SamplerInfo(_message.Message):
    __slots__ = ("sampler_id", "base_model", "model_path")
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    sampler_id: str
    base_model: str
    model_path: str
    def __init__(self, sampler_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_path: _Optional[str] = ...) -> None: ...

class CapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SupportedModel(_message.Message):
    __slots__ = ("model_name", "max_context_length", "max_tokens_per_datum", "trainer_memory_budget_bytes", "custom_loss_max_flops_per_token", "custom_loss_max_memory_bytes", "trainer_path", "trainer_kernels", "sampler_kernels")
    class TrainerKernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SamplerKernelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_DATUM_FIELD_NUMBER: _ClassVar[int]
    TRAINER_MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_MAX_FLOPS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_PATH_FIELD_NUMBER: _ClassVar[int]
    TRAINER_KERNELS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_KERNELS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_context_length: int
    max_tokens_per_datum: int
    trainer_memory_budget_bytes: int
    custom_loss_max_flops_per_token: int
    custom_loss_max_memory_bytes: int
    trainer_path: str
    trainer_kernels: _containers.ScalarMap[str, str]
    sampler_kernels: _containers.ScalarMap[str, str]
    def __init__(self, model_name: _Optional[str] = ..., max_context_length: _Optional[int] = ..., max_tokens_per_datum: _Optional[int] = ..., trainer_memory_budget_bytes: _Optional[int] = ..., custom_loss_max_flops_per_token: _Optional[int] = ..., custom_loss_max_memory_bytes: _Optional[int] = ..., trainer_path: _Optional[str] = ..., trainer_kernels: _Optional[_Mapping[str, str]] = ..., sampler_kernels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EngineCapabilities(_message.Message):
    __slots__ = ("trainer", "losses", "custom_loss", "trainer_inputs", "optimizers", "sampler", "sampler_inputs")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    LOSSES_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_INPUTS_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    losses: _containers.RepeatedScalarFieldContainer[str]
    custom_loss: bool
    trainer_inputs: _containers.RepeatedScalarFieldContainer[str]
    optimizers: _containers.RepeatedScalarFieldContainer[str]
    sampler: str
    sampler_inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trainer: _Optional[str] = ..., losses: _Optional[_Iterable[str]] = ..., custom_loss: bool = ..., trainer_inputs: _Optional[_Iterable[str]] = ..., optimizers: _Optional[_Iterable[str]] = ..., sampler: _Optional[str] = ..., sampler_inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class ServerCapabilities(_message.Message):
    __slots__ = ("models", "engines", "version", "state_format")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[SupportedModel]
    engines: EngineCapabilities
    version: str
    state_format: int
    def __init__(self, models: _Optional[_Iterable[_Union[SupportedModel, _Mapping]]] = ..., engines: _Optional[_Union[EngineCapabilities, _Mapping]] = ..., version: _Optional[str] = ..., state_format: _Optional[int] = ...) -> None: ...

class RunRef(_message.Message):
    __slots__ = ("owner", "run_id", "all_owners")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_OWNERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    run_id: str
    all_owners: bool
    def __init__(self, owner: _Optional[str] = ..., run_id: _Optional[str] = ..., all_owners: bool = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("checkpoint_id", "checkpoint_type", "time", "tinker_path", "size_bytes", "public", "expires_at", "user_metadata")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    checkpoint_type: str
    time: float
    tinker_path: str
    size_bytes: int
    public: bool
    expires_at: float
    user_metadata: _containers.ScalarMap[str, str]
    def __init__(self, checkpoint_id: _Optional[str] = ..., checkpoint_type: _Optional[str] = ..., time: _Optional[float] = ..., tinker_path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., public: bool = ..., expires_at: _Optional[float] = ..., user_metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TrainingRun(_message.Message):
    __slots__ = ("training_run_id", "base_model", "model_owner", "is_lora", "last_request_time", "lora_rank", "last_checkpoint", "last_sampler_checkpoint", "user_metadata", "steps", "tokens_trained", "status", "queued")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAINING_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_OWNER_FIELD_NUMBER: _ClassVar[int]
    IS_LORA_FIELD_NUMBER: _ClassVar[int]
    LAST_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    LAST_SAMPLER_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool
    last_request_time: float
    lora_rank: int
    last_checkpoint: Checkpoint
    last_sampler_checkpoint: Checkpoint
    user_metadata: _containers.ScalarMap[str, str]
    steps: int
    tokens_trained: int
    status: str
    queued: int
    def __init__(self, training_run_id: _Optional[str] = ..., base_model: _Optional[str] = ..., model_owner: _Optional[str] = ..., is_lora: bool = ..., last_request_time: _Optional[float] = ..., lora_rank: _Optional[int] = ..., last_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., last_sampler_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., steps: _Optional[int] = ..., tokens_trained: _Optional[int] = ..., status: _Optional[str] = ..., queued: _Optional[int] = ...) -> None: ...

class TrainingRunList(_message.Message):
    __slots__ = ("runs", "total_count")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[TrainingRun]
    total_count: int
    def __init__(self, runs: _Optional[_Iterable[_Union[TrainingRun, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("owner", "run_id", "limit", "offset", "all_owners")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ALL_OWNERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    run_id: str
    limit: int
    offset: int
    all_owners: bool
    def __init__(self, owner: _Optional[str] = ..., run_id: _Optional[str] = ..., limit: _Optional[int] = ..., offset: _Optional[int] = ..., all_owners: bool = ...) -> None: ...

class CheckpointList(_message.Message):
    __slots__ = ("checkpoints", "total_count")
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[Checkpoint]
    total_count: int
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[Checkpoint, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...

class CheckpointRef(_message.Message):
    __slots__ = ("owner", "tinker_path")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    owner: str
    tinker_path: str
    def __init__(self, owner: _Optional[str] = ..., tinker_path: _Optional[str] = ...) -> None: ...

class SetCheckpointPublicRequest(_message.Message):
    __slots__ = ("ref", "public")
    REF_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    public: bool
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., public: bool = ...) -> None: ...

class SetCheckpointTtlRequest(_message.Message):
    __slots__ = ("ref", "ttl_seconds")
    REF_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ref: CheckpointRef
    ttl_seconds: int
    def __init__(self, ref: _Optional[_Union[CheckpointRef, _Mapping]] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class CheckpointFiles(_message.Message):
    __slots__ = ("directory", "relative_paths", "expires")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_PATHS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_FIELD_NUMBER: _ClassVar[int]
    directory: str
    relative_paths: _containers.RepeatedScalarFieldContainer[str]
    expires: float
    def __init__(self, directory: _Optional[str] = ..., relative_paths: _Optional[_Iterable[str]] = ..., expires: _Optional[float] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "time", "metrics", "datums", "tokens", "complete", "steps")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DATUMS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    step: int
    time: float
    metrics: _containers.ScalarMap[str, float]
    datums: int
    tokens: int
    complete: bool
    steps: int
    def __init__(self, step: _Optional[int] = ..., time: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ..., datums: _Optional[int] = ..., tokens: _Optional[int] = ..., complete: bool = ..., steps: _Optional[int] = ...) -> None: ...

class RunHistoryRequest(_message.Message):
    __slots__ = ("run", "most_points")
    RUN_FIELD_NUMBER: _ClassVar[int]
    MOST_POINTS_FIELD_NUMBER: _ClassVar[int]
    run: RunRef
    most_points: int
    def __init__(self, run: _Optional[_Union[RunRef, _Mapping]] = ..., most_points: _Optional[int] = ...) -> None: ...

class RunHistory(_message.Message):
    __slots__ = ("steps", "first_step")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepMetrics]
    first_step: int
    def __init__(self, steps: _Optional[_Iterable[_Union[StepMetrics, _Mapping]]] = ..., first_step: _Optional[int] = ...) -> None: ...

class QueuedFuture(_message.Message):
    __slots__ = ("request_id", "kind", "seq_id", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    seq_id: int
    status: str
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., seq_id: _Optional[int] = ..., status: _Optional[str] = ...) -> None: ...

class RunFutures(_message.Message):
    __slots__ = ("futures", "total_count")
    FUTURES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COUNT_FIELD_NUMBER: _ClassVar[int]
    futures: _containers.RepeatedCompositeFieldContainer[QueuedFuture]
    total_count: int
    def __init__(self, futures: _Optional[_Iterable[_Union[QueuedFuture, _Mapping]]] = ..., total_count: _Optional[int] = ...) -> None: ...

class WeightsInfo(_message.Message):
    __slots__ = ("base_model", "is_lora", "lora_config")
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    IS_LORA_FIELD_NUMBER: _ClassVar[int]
    LORA_CONFIG_FIELD_NUMBER: _ClassVar[int]
    base_model: str
    is_lora: bool
    lora_config: LoraConfig
    def __init__(self, base_model: _Optional[str] = ..., is_lora: bool = ..., lora_config: _Optional[_Union[LoraConfig, _Mapping]] = ...) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "parts", "version", "state_format")
    class PartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    READY_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    parts: _containers.ScalarMap[str, str]
    version: str
    state_format: int
    def __init__(self, ready: bool = ..., parts: _Optional[_Mapping[str, str]] = ..., version: _Optional[str] = ..., state_format: _Optional[int] = ...) -> None: ...

class OwnerRef(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class StorageUsageReply(_message.Message):
    __slots__ = ("checkpoint_count", "size_bytes")
    CHECKPOINT_COUNT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    checkpoint_count: int
    size_bytes: int
    def __init__(self, checkpoint_count: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("owner", "start", "end", "all_owners")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ALL_OWNERS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    start: float
    end: float
    all_owners: bool
    def __init__(self, owner: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ..., all_owners: bool = ...) -> None: ...

class UsageBucket(_message.Message):
    __slots__ = ("start", "session_id", "base_model", "tokens_trained", "tokens_prefill", "tokens_sampled", "steps", "samples", "cycle_seconds", "checkpoints", "custom_losses", "owner")
    START_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CYCLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_LOSSES_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    start: float
    session_id: str
    base_model: str
    tokens_trained: int
    tokens_prefill: int
    tokens_sampled: int
    steps: int
    samples: int
    cycle_seconds: float
    checkpoints: int
    custom_losses: int
    owner: str
    def __init__(self, start: _Optional[float] = ..., session_id: _Optional[str] = ..., base_model: _Optional[str] = ..., tokens_trained: _Optional[int] = ..., tokens_prefill: _Optional[int] = ..., tokens_sampled: _Optional[int] = ..., steps: _Optional[int] = ..., samples: _Optional[int] = ..., cycle_seconds: _Optional[float] = ..., checkpoints: _Optional[int] = ..., custom_losses: _Optional[int] = ..., owner: _Optional[str] = ...) -> None: ...

class UsageReply(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[UsageBucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[UsageBucket, _Mapping]]] = ...) -> None: ...

class AuditLogRequest(_message.Message):
    __slots__ = ("owner", "start", "end")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    owner: str
    start: float
    end: float
    def __init__(self, owner: _Optional[str] = ..., start: _Optional[float] = ..., end: _Optional[float] = ...) -> None: ...

class AuditEntry(_message.Message):
    __slots__ = ("time", "event", "details_json")
    TIME_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    DETAILS_JSON_FIELD_NUMBER: _ClassVar[int]
    time: float
    event: str
    details_json: str
    def __init__(self, time: _Optional[float] = ..., event: _Optional[str] = ..., details_json: _Optional[str] = ...) -> None: ...

class AuditLogReply(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[AuditEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[AuditEntry, _Mapping]]] = ...) -> None: ...

class SearchSessionsRequest(_message.Message):
    __slots__ = ("owner", "session_id", "display_name", "user_metadata", "statuses", "limit", "before_created", "before_session_id")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BEFORE_CREATED_FIELD_NUMBER: _ClassVar[int]
    BEFORE_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    owner: str
    session_id: str
    display_name: str
    user_metadata: _containers.ScalarMap[str, str]
    statuses: _containers.RepeatedScalarFieldContainer[str]
    limit: int
    before_created: float
    before_session_id: str
    def __init__(self, owner: _Optional[str] = ..., session_id: _Optional[str] = ..., display_name: _Optional[str] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., statuses: _Optional[_Iterable[str]] = ..., limit: _Optional[int] = ..., before_created: _Optional[float] = ..., before_session_id: _Optional[str] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session_id", "created", "project_id", "status", "checkpoints_count", "display_name", "user_metadata", "checkpoint_storage_bytes")
    class UserMetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PROJECT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_COUNT_FIELD_NUMBER: _ClassVar[int]
    DISPLAY_NAME_FIELD_NUMBER: _ClassVar[int]
    USER_METADATA_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    created: float
    project_id: str
    status: str
    checkpoints_count: int
    display_name: str
    user_metadata: _containers.ScalarMap[str, str]
    checkpoint_storage_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., created: _Optional[float] = ..., project_id: _Optional[str] = ..., status: _Optional[str] = ..., checkpoints_count: _Optional[int] = ..., display_name: _Optional[str] = ..., user_metadata: _Optional[_Mapping[str, str]] = ..., checkpoint_storage_bytes: _Optional[int] = ...) -> None: ...

class SessionSummaryList(_message.Message):
    __slots__ = ("sessions", "more")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    more: bool
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ..., more: bool = ...) -> None: ...

class CopyWeightsRequest(_message.Message):
    __slots__ = ("owner", "source_path", "session_id", "model_seq_id", "ttl_seconds")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    SOURCE_PATH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    source_path: str
    session_id: str
    model_seq_id: int
    ttl_seconds: int
    def __init__(self, owner: _Optional[str] = ..., source_path: _Optional[str] = ..., session_id: _Optional[str] = ..., model_seq_id: _Optional[int] = ..., ttl_seconds: _Optional[int] = ...) -> None: ...

class CopyWeightsReply(_message.Message):
    __slots__ = ("tinker_path",)
    TINKER_PATH_FIELD_NUMBER: _ClassVar[int]
    tinker_path: str
    def __init__(self, tinker_path: _Optional[str] = ...) -> None: ...
