"""A forward_backward's contents are judged once, by the scheduler's decoding and validation
(`translate.pass_request` + `losses.validate_pass_request`, what `Submissions` runs): each rule
names the offending field. The gateway checks only the request's address (test_gateway_codec)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lockstep.engine import losses
from lockstep.errors import UserInputError
from lockstep.scheduler import translate
from lockstep.wire.v1 import tinker_pb2

Mutation = Callable[[tinker_pb2.ForwardBackwardRequest], object]


def _request() -> tinker_pb2.ForwardBackwardRequest:
    req = tinker_pb2.ForwardBackwardRequest(
        model_id="sess-1:train:0", seq_id=1, loss_fn="cross_entropy"
    )
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = b"".join(
        t.to_bytes(4, "little") for t in (1, 2, 3)
    )
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = (
        tinker_pb2.DTYPE_INT64,
        b"".join(t.to_bytes(8, "little") for t in (2, 3, 4)),
    )
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = tinker_pb2.DTYPE_FLOAT32, b"\0\0\x80\x3f" * 3
    weights.shape.append(3)
    return req


def _judge(req: tinker_pb2.ForwardBackwardRequest) -> None:
    losses.validate_pass_request(translate.pass_request("x", req), vocab_size=100, max_context=64)


def test_a_well_formed_request_passes() -> None:
    _judge(_request())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: setattr(r, "loss_fn", ""), "loss_fn: unsupported loss ''"),
        (lambda r: r.ClearField("data"), "data: no datums"),
        (lambda r: r.data[0].ClearField("model_input"), "data[0].model_input: is empty"),
        (lambda r: r.data[0].model_input.add(), "data[0].model_input.chunks[1]: empty chunk"),
        (
            lambda r: setattr(r.data[0].model_input[0].encoded_text, "tokens", b"\0" * 5),
            "data[0].model_input.chunks[0].tokens: not a whole number of int32 values",
        ),
        (
            lambda r: setattr(r.data[0].loss_fn_inputs["weights"], "dense", b"\0" * 5),
            "data[0].loss_fn_inputs.weights: 5 bytes is not a whole number of float32",
        ),
        (
            lambda r: r.data[0].loss_fn_inputs["weights"].shape.append(99),
            "data[0].loss_fn_inputs.weights: shape [3, 99] does not match 3 elements",
        ),
        (
            lambda r: setattr(r.data[0].loss_fn_inputs["weights"], "dtype", 99),
            "data[0].loss_fn_inputs.weights: unknown dtype 99",
        ),
        (
            lambda r: setattr(
                r.data[0].loss_fn_inputs["weights"], "dtype", tinker_pb2.DTYPE_BFLOAT16
            ),
            "data[0].loss_fn_inputs.weights: bfloat16 tensors are not accepted",
        ),
        (
            lambda r: setattr(
                r.data[0].model_input[0].encoded_text, "tokens", (500).to_bytes(4, "little") * 3
            ),
            "data[0].model_input",
        ),
    ],
)
def test_each_rule_names_its_field(mutate: Mutation, message: str) -> None:
    req = _request()
    mutate(req)
    with pytest.raises(UserInputError) as err:
        _judge(req)
    assert str(err.value).startswith(message), str(err.value)
