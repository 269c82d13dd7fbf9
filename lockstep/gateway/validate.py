"""Checks the gateway does before calling the scheduler.

Only a request's envelope: ids are URL-safe, counters are in range, floats are finite. What a
forward_backward carries (its datums, tensors and loss) is the scheduler's to judge, once: it
decodes the request for the engine and validates as it goes, and answers INVALID_ARGUMENT with
a message naming the field, which the gateway passes through.
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
    with as_bad_request():
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
def as_bad_request() -> Iterator[None]:
    """The shared rules (lockstep.paths, lockstep.vocab) raise UserInputError; here a 400."""
    try:
        yield
    except UserInputError as exc:
        raise bad_request(exc.field, exc.detail) from exc


def parse_tinker_path(field: str, value: str | None) -> TinkerPath:
    """`tinker://<run>/<weights|sampler_weights|external_weights>/<name>`, by the scheduler's own
    rule (lockstep.paths), so a path that passes here passes there."""
    if not value:
        raise bad_request(field, "field required")
    with as_bad_request():
        return TinkerPath.parse(value, field)


def checkpoint_path(run_id: str, segment: str, name: str) -> TinkerPath:
    """The checkpoint a REST path `.../training_runs/{run}/checkpoints/{segment}/{name}` names."""
    check_id("training_run_id", run_id)
    if segment not in SEGMENT_TYPES:
        raise ApiError(404, f"checkpoint type {segment!r} is not one of {', '.join(SEGMENT_TYPES)}")
    with as_bad_request():
        return TinkerPath(
            validate_run_id(run_id, "training_run_id"),
            segment,
            validate_name(name, "checkpoint name"),
        )


def check_addressed(req: tinker_pb2.ForwardBackwardRequest) -> None:
    """What the gateway checks of a fwd/bwd request: its model id and seq_id (the request's
    address). Its contents are the scheduler's to judge, once (lockstep.scheduler.translate and
    lockstep.engine.losses), so every rule has one implementation and one message."""
    check_id("model_id", req.model_id)
    check_seq_id(req.seq_id)
