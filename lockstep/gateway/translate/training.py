"""Training requests (create_model, fwd/bwd, optim_step, save/load) -> `SubmitRequest`."""

from __future__ import annotations

import base64
import binascii

import numpy as np
from google.protobuf.message import DecodeError

from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.common import optional_str, str_map
from lockstep.gateway.validate import (
    check_addressed,
    check_id,
    check_name,
    check_seq_id,
    parse_tinker_path,
)
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2

_ADAMW = ("adamw", "adam")


def _check_optimizer_family(field: str, family: str | None) -> None:
    if family is not None and family.lower() not in _ADAMW:
        raise bad_request(field, f"optimizer {family!r} is not supported; this server has adamw")


def create_model(owner: str, body: rq.CreateModelRequest) -> pb.SubmitRequest:
    check_id("session_id", body.session_id)
    if body.optimizer_config is not None:
        _check_optimizer_family("optimizer_config.type", body.optimizer_config.type)
    op = pb.CreateModel(
        session_id=body.session_id,
        model_seq_id=body.model_seq_id,
        base_model=body.base_model,
        user_metadata=str_map(body.user_metadata),
        optimizer_type="adamw",
    )
    lora = body.lora_config
    if lora is not None:
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise bad_request(
                "lora_config", "at least one of train_mlp, train_attn, train_unembed must be true"
            )
        op.lora_config.CopyFrom(
            pb.LoraConfig(
                rank=lora.rank,
                seed=lora.seed,
                train_unembed=lora.train_unembed,
                train_mlp=lora.train_mlp,
                train_attn=lora.train_attn,
            )
        )
    return pb.SubmitRequest(owner=owner, create_model=op)


def forward_backward_from_proto(owner: str, body: bytes) -> pb.SubmitRequest:
    """Decode the SDK's protobuf fwd/bwd body straight into the submit request."""
    req = pb.SubmitRequest(owner=owner)
    try:
        req.forward_backward.ParseFromString(body)
    except DecodeError as e:
        raise bad_request("body", "not a valid ForwardBackwardRequest") from e
    check_addressed(req.forward_backward)
    return req


_NP_DTYPE = {"float32": ("<f4", tinker_pb2.DTYPE_FLOAT32), "int64": ("<i8", tinker_pb2.DTYPE_INT64)}


def _tensor(field: str, td: rq.TensorData) -> tinker_pb2.Tensor:
    np_dtype, dtype = _NP_DTYPE[td.dtype]
    try:
        values = np.asarray(td.data, dtype=np_dtype).tobytes()
        msg = tinker_pb2.Tensor(dtype=dtype, shape=td.shape or [])
        if td.sparse_crow_indices is not None or td.sparse_col_indices is not None:
            msg.sparse_csr.values = values
            msg.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices or [], "<i8").tobytes()
            msg.sparse_csr.col_indices = np.asarray(td.sparse_col_indices or [], "<i8").tobytes()
        else:
            msg.dense = values
    except (OverflowError, ValueError) as e:
        raise bad_request(field, f"values do not fit {td.dtype}") from e
    return msg


def _b64(field: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(field, "not valid base64") from e


def _chunk(field: str, chunk: rq.Chunk) -> tinker_pb2.Chunk:
    if isinstance(chunk, rq.EncodedTextChunk):
        try:
            tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
        except OverflowError as e:
            raise bad_request(f"{field}.tokens", "token ids must fit int32") from e
        return tinker_pb2.Chunk(encoded_text=tinker_pb2.EncodedTextChunk(tokens=tokens))
    if isinstance(chunk, rq.ImageChunk):
        image = tinker_pb2.ImageChunk(data=_b64(f"{field}.data", chunk.data), format=chunk.format)
        if chunk.expected_tokens is not None:
            image.expected_tokens = chunk.expected_tokens
        return tinker_pb2.Chunk(image=image)
    if isinstance(chunk, rq.DmelChunk):
        return tinker_pb2.Chunk(dmel=tinker_pb2.DmelChunk(dmel=_b64(f"{field}.dmel", chunk.dmel)))
    raise bad_request(field, f"chunk type {chunk.type!r} is not supported")


def forward_backward_from_json(owner: str, body: rq.ForwardBackwardJsonRequest) -> pb.SubmitRequest:
    """The JSON form of a fwd/bwd request, converted to the same proto the SDK would send."""
    forward_only = body.forward_backward_input is None
    fb_input = body.forward_backward_input or body.forward_input
    if fb_input is None:
        raise bad_request("forward_backward_input", "field required")
    fb = tinker_pb2.ForwardBackwardRequest(
        model_id=body.model_id,
        seq_id=check_seq_id(body.seq_id),
        loss_fn=fb_input.loss_fn,
        forward_only=forward_only,
    )
    for key, value in (fb_input.loss_fn_config or {}).items():
        if isinstance(value, str):
            fb.loss_fn_config_v2[key].text = value
        else:
            fb.loss_fn_config[key] = float(value)
            fb.loss_fn_config_v2[key].number = float(value)
    for i, datum in enumerate(fb_input.data):
        d = fb.data.add()
        for j, chunk in enumerate(datum.model_input.chunks):
            d.model_input.append(_chunk(f"data[{i}].model_input.chunks[{j}]", chunk))
        for name, td in datum.loss_fn_inputs.items():
            d.loss_fn_inputs[name].CopyFrom(_tensor(f"data[{i}].loss_fn_inputs.{name}", td))
    check_addressed(fb)
    return pb.SubmitRequest(owner=owner, forward_backward=fb)


def optim_step(owner: str, body: rq.OptimStepRequest) -> pb.SubmitRequest:
    check_id("model_id", body.model_id)
    seq_id = check_seq_id(body.seq_id)
    for field in ("adam_params", "optimizer_params", "optim_params"):
        params: rq.OptimParams | None = getattr(body, field)
        if params is not None:
            break
    else:
        raise bad_request("adam_params", "field required")
    # Ranges and finiteness of the numbers were checked by the wire model (OptimParams).
    _check_optimizer_family(f"{field}.type", params.type)
    adam = pb.AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )
    return pb.SubmitRequest(
        owner=owner, optim_step=pb.OptimStep(model_id=body.model_id, seq_id=seq_id, adam=adam)
    )


def save_weights(owner: str, body: rq.SaveWeightsRequest) -> pb.SubmitRequest:
    op = pb.SaveWeights(
        model_id=check_id("model_id", body.model_id),
        seq_id=check_seq_id(body.seq_id),
        kind=pb.CHECKPOINT_KIND_TRAINING,
        name=check_name("path", body.path),
        ttl_seconds=body.ttl_seconds,
        overwrite=body.overwrite,
        user_metadata=str_map(body.user_metadata),
    )
    return pb.SubmitRequest(owner=owner, save_weights=op)


def save_weights_for_sampler(owner: str, body: rq.SaveWeightsForSamplerRequest) -> pb.SubmitRequest:
    """Named form (`path` = name) saves a sampler checkpoint; the unnamed form
    (`sampling_session_seq_id`) saves ephemeral weights and creates that sampling session."""
    if body.kind not in ("snapshot", "inflight"):
        raise bad_request("kind", "must be 'snapshot' or 'inflight'")
    op = pb.SaveWeights(
        model_id=check_id("model_id", body.model_id),
        seq_id=check_seq_id(body.seq_id),
        kind=pb.CHECKPOINT_KIND_SAMPLER,
        ttl_seconds=body.ttl_seconds,
        user_metadata=str_map(body.user_metadata),
    )
    if body.path is not None:
        op.name = check_name("path", body.path)
    elif body.sampling_session_seq_id is not None:
        op.sampling_session_seq_id = body.sampling_session_seq_id
        if body.kind == "inflight":
            op.sampler_kind = pb.SAMPLER_KIND_INFLIGHT
    else:
        raise bad_request("path", "give a name (path) or a sampling_session_seq_id")
    return pb.SubmitRequest(owner=owner, save_weights=op)


def save_weights_external(owner: str, body: rq.SaveWeightsExternalRequest) -> pb.SubmitRequest:
    op = pb.SaveWeights(
        model_id=check_id("model_id", body.model_id),
        seq_id=check_seq_id(body.seq_id),
        kind=pb.CHECKPOINT_KIND_EXTERNAL,
        name=check_name("path", body.path),
        ttl_seconds=body.ttl_seconds,
        age_recipients=body.age_encryption_recipients or [],
    )
    return pb.SubmitRequest(owner=owner, save_weights=op)


def load_weights(owner: str, body: rq.LoadWeightsRequest) -> pb.SubmitRequest:
    """Legacy form (model_id + seq_id) loads into a model; create-via-load (session_id +
    model_seq_id) creates model `<session_id>:train:<model_seq_id>` from the checkpoint."""
    path = parse_tinker_path("path", body.path)
    if body.optimizer_config is not None:
        _check_optimizer_family("optimizer_config.type", body.optimizer_config.type)
    op = pb.LoadWeights(
        path=str(path),
        optimizer=body.optimizer,
        user_metadata=str_map(body.user_metadata),
        base_model=body.base_model or None,
    )
    if body.model_id is not None:
        op.model_id = check_id("model_id", body.model_id)
        op.seq_id = check_seq_id(body.seq_id)
    elif body.session_id is not None:
        op.session_id = check_id("session_id", body.session_id)
        if body.model_seq_id is None:
            raise bad_request("model_seq_id", "field required with session_id")
        op.model_seq_id = body.model_seq_id
    else:
        raise bad_request("model_id", "give model_id + seq_id, or session_id + model_seq_id")
    return pb.SubmitRequest(owner=owner, load_weights=op)


def future(reply: pb.SubmitReply) -> rs.UntypedAPIFuture:
    return rs.UntypedAPIFuture(request_id=reply.request_id, model_id=optional_str(reply.model_id))


def model_info(info: pb.ModelInfo) -> rs.GetInfoResponse:
    rank = info.lora_rank or info.lora_config.rank
    return rs.GetInfoResponse(
        model_id=info.model_id,
        model_data=rs.ModelData(
            arch=optional_str(info.arch),
            model_name=info.base_model,
            tokenizer_id=optional_str(info.tokenizer_id),
        ),
        is_lora=rank > 0,
        lora_rank=rank or None,
        model_name=info.base_model,
        max_tokens_per_datum=info.max_tokens_per_datum or None,
    )
