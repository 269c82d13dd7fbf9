"""Shape checks the gateway does before calling the scheduler.

Only what can be judged from the request alone: ids are URL-safe, counters are in range,
floats are finite, a fwd/bwd body is well-formed. Everything that needs state (does the model
exist, is the token in the vocabulary, are the loss inputs right for the loss) is the
scheduler's, which answers INVALID_ARGUMENT with a message the gateway passes through.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager

from lockstep.errors import UserInputError
from lockstep.gateway.errors import ApiError, bad_request
from lockstep.paths import SEGMENT_TYPES, TinkerPath, validate_name, validate_run_id
from lockstep.wire.v1 import tinker_pb2

# The SDK interpolates ids into URL paths unescaped: no '/', '?', '#', '%', spaces.
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+~=-]{0,255}")

_INT32_MAX = 2**31 - 1


def check_id(field: str, value: str | None) -> str:
    if not value:
        raise bad_request(field, "field required")
    if not _ID.fullmatch(value):
        raise bad_request(field, f"{value!r} is not a valid id (letters, digits, '._:@+~=-')")
    return value


def check_name(field: str, value: str | None) -> str:
    """A checkpoint name to save under (lockstep.paths.validate_name)."""
    if not value:
        raise bad_request(field, "field required")
    with _as_bad_request():
        return validate_name(value, field)


def check_seq_id(value: int | None, field: str = "seq_id") -> int:
    """Training requests carry seq_id 1, 2, 3, ... (0 is 'unset' on the proto wire)."""
    if value is None:
        raise bad_request(field, "field required")
    if value < 1:
        raise bad_request(field, "must be >= 1")
    if value > _INT32_MAX:
        raise bad_request(field, f"must be <= {_INT32_MAX}")
    return value


def check_finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise bad_request(field, "must be a finite number")
    return value


@contextmanager
def _as_bad_request() -> Iterator[None]:
    """The shared rules (lockstep.paths) raise UserInputError; here that is a 400."""
    try:
        yield
    except UserInputError as exc:
        raise bad_request(exc.field, exc.detail) from exc


def parse_tinker_path(field: str, value: str | None) -> TinkerPath:
    """`tinker://<run>/<weights|sampler_weights|external_weights>/<name>`, by the scheduler's own
    rule (lockstep.paths), so a path that passes here passes there."""
    if not value:
        raise bad_request(field, "field required")
    with _as_bad_request():
        return TinkerPath.parse(value, field)


def checkpoint_path(run_id: str, segment: str, name: str) -> TinkerPath:
    """The checkpoint a REST path `.../training_runs/{run}/checkpoints/{segment}/{name}` names."""
    check_id("training_run_id", run_id)
    if segment not in SEGMENT_TYPES:
        raise ApiError(404, f"checkpoint type {segment!r} is not one of {', '.join(SEGMENT_TYPES)}")
    with _as_bad_request():
        return TinkerPath(
            validate_run_id(run_id, "training_run_id"),
            segment,
            validate_name(name, "checkpoint name"),
        )


_DENSE_ITEMSIZE = {tinker_pb2.DTYPE_FLOAT32: 4, tinker_pb2.DTYPE_INT64: 8}


def _check_tensor(field: str, t: tinker_pb2.Tensor) -> None:
    itemsize = _DENSE_ITEMSIZE.get(t.dtype)
    if itemsize is None:
        raise bad_request(field, "dtype must be float32 or int64")
    if any(d < 0 for d in t.shape):
        raise bad_request(field, "shape has a negative dimension")
    encoding = t.WhichOneof("encoding")
    if encoding == "sparse_csr":
        csr = t.sparse_csr
        if len(t.shape) != 2:
            raise bad_request(field, "a sparse_csr tensor needs a 2-D shape")
        if len(csr.values) % itemsize or len(csr.crow_indices) % 8 or len(csr.col_indices) % 8:
            raise bad_request(field, "sparse_csr buffers are not whole elements")
        if len(csr.crow_indices) // 8 != t.shape[0] + 1:
            raise bad_request(field, "sparse_csr.crow_indices must have shape[0] + 1 entries")
        if len(csr.col_indices) // 8 != len(csr.values) // itemsize:
            raise bad_request(field, "sparse_csr.col_indices and values differ in length")
        return
    if len(t.dense) % itemsize:
        raise bad_request(field, "dense bytes are not a whole number of elements")
    if t.shape:
        numel = math.prod(t.shape)
        if numel * itemsize != len(t.dense):
            raise bad_request(
                field,
                f"shape {list(t.shape)} needs {numel} elements, got {len(t.dense) // itemsize}",
            )


def check_forward_backward(req: tinker_pb2.ForwardBackwardRequest) -> None:
    """Shape checks of a decoded fwd/bwd request; names the offending field."""
    check_id("model_id", req.model_id)
    check_seq_id(req.seq_id)
    if not req.loss_fn:
        raise bad_request("loss_fn", "field required")
    if not req.data:
        raise bad_request("data", "must contain at least one datum")
    for key, value in req.loss_fn_config.items():
        check_finite(f"loss_fn_config.{key}", value)
    for key, cfg in req.loss_fn_config_v2.items():
        if cfg.WhichOneof("value") == "number":
            check_finite(f"loss_fn_config_v2.{key}", cfg.number)
    for i, datum in enumerate(req.data):
        if not datum.model_input:
            raise bad_request(f"data[{i}].model_input", "must contain at least one chunk")
        for j, chunk in enumerate(datum.model_input):
            kind = chunk.WhichOneof("chunk")
            if kind is None:
                raise bad_request(f"data[{i}].model_input[{j}]", "empty chunk")
            if kind == "encoded_text" and len(chunk.encoded_text.tokens) % 4:
                raise bad_request(
                    f"data[{i}].model_input[{j}].encoded_text.tokens", "not int32 bytes"
                )
        for name, tensor in datum.loss_fn_inputs.items():
            _check_tensor(f"data[{i}].loss_fn_inputs.{name}", tensor)
