"""The JSON form of a forward_backward as the SDK's protobuf (chunks, tensors), and get_info's
answer."""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.translate.chunks import wire_chunk
from lockstep.gateway.translate.common import optional_str
from lockstep.gateway.validate import (
    check_addressed,
    check_seq_id,
)
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2

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


def forward_backward_from_proto(owner: str, body: bytes) -> pb.SubmitRequest:
    """Decode the SDK's protobuf fwd/bwd body straight into the submit request."""
    req = pb.SubmitRequest(owner=owner)
    try:
        req.forward_backward.ParseFromString(body)
    except DecodeError as e:
        raise bad_request("body", "not a valid ForwardBackwardRequest") from e
    check_addressed(req.forward_backward)
    return req


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
            d.model_input.append(wire_chunk(f"data[{i}].model_input.chunks[{j}]", chunk))
        for name, td in datum.loss_fn_inputs.items():
            d.loss_fn_inputs[name].CopyFrom(_tensor(f"data[{i}].loss_fn_inputs.{name}", td))
    check_addressed(fb)
    return pb.SubmitRequest(owner=owner, forward_backward=fb)


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
        custom_loss_max_flops_per_token=info.custom_loss_max_flops_per_token or None,
        custom_loss_max_memory_bytes=info.custom_loss_max_memory_bytes or None,
        trainer_path=optional_str(info.trainer_path),
        trainer_kernels=dict(info.trainer_kernels) or None,
    )
