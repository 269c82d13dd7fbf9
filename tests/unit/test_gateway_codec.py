"""The gateway's binary codecs against the tinker SDK's own: our copy of the wire schema
(`lockstep.wire.v1.tinker_pb2`) must read what the SDK writes and write what the SDK reads."""

from __future__ import annotations

import dataclasses
import gzip

import numpy as np
import pytest
import torch
import zstandard
from google.protobuf.descriptor import Descriptor, EnumDescriptor
from tinker import types
from tinker.proto import request_conv, response_conv, tinker_public_pb2
from tinker.types.provenance_spans import PromptProvenanceSpan, SampledProvenanceSpan

from lockstep.config import LockstepConfig
from lockstep.config.sections import FwdbwdCompression
from lockstep.gateway.__main__ import settings_from_config
from lockstep.gateway.body import BodyError, decompress
from lockstep.gateway.errors import ApiError
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.settings import compress_fwdbwd
from lockstep.gateway.translate import training
from lockstep.wire.v1 import tinker_pb2


def _sdk_request() -> tinker_public_pb2.ForwardBackwardRequest:
    """A fwd/bwd request built by the SDK's own conversion code, exercising every arm."""
    dense = types.Datum(
        model_input=types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[10, 11, 12, 13]),
                types.ImageChunk(data=b"\x89PNG...", format="png", expected_tokens=2),
            ]
        ),
        loss_fn_inputs={
            "target_tokens": [11, 12, 13, 14, 15, 16],
            "weights": [0.0, 1.0, 1.0, 1.0, 0.5, 0.25],
            "advantages": np.array([0.5, -0.5, 1.0, 2.0, 0.0, 1.0], dtype=np.float32),
        },
    ).with_provenance(
        model_input=[
            PromptProvenanceSpan(sequence_id="req-1:seq:0", offset=0, length=4),
            SampledProvenanceSpan(sequence_id="req-1:seq:0", offset=0, length=2),
        ],
        loss_fn_inputs=[SampledProvenanceSpan(sequence_id="req-1:seq:0", length=6)],
    )
    targets = torch.zeros((3, 4), dtype=torch.int64)
    targets[0, 0], targets[2, 2] = 5, 7
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": targets, "weights": torch.ones((3, 4))},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[dense, sparse],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.8, "mode": "token"},
        ),
        model_id="sess-1:train:0",
        seq_id=3,
    )
    return request_conv.forward_backward_request_to_proto(request)


def test_sdk_forward_backward_request_decodes_byte_for_byte() -> None:
    sdk = _sdk_request()
    wire = sdk.SerializeToString(deterministic=True)
    ours = tinker_pb2.ForwardBackwardRequest.FromString(wire)

    assert ours.SerializeToString(deterministic=True) == wire
    assert (ours.model_id, ours.seq_id, ours.loss_fn) == ("sess-1:train:0", 3, "ppo")
    assert dict(ours.loss_fn_config) == pytest.approx({"clip_low_threshold": 0.8})
    assert ours.loss_fn_config_v2["mode"].text == "token"
    d0, d1 = ours.data
    tokens = np.frombuffer(d0.model_input[0].encoded_text.tokens, dtype="<i4")
    assert tokens.tolist() == [10, 11, 12, 13]
    assert d0.model_input[1].image.format == "png"
    assert d0.model_input[1].image.expected_tokens == 2
    assert d0.loss_fn_inputs["target_tokens"].dtype == tinker_pb2.DTYPE_INT64
    assert np.frombuffer(d0.loss_fn_inputs["weights"].dense, "<f4")[4] == 0.5
    assert d0.model_input_spans[1].sampled_tokens.length == 2
    assert d0.loss_fn_input_spans[0].sampled_tokens.sequence_id == "req-1:seq:0"
    csr = d1.loss_fn_inputs["target_tokens"]
    assert csr.WhichOneof("encoding") == "sparse_csr"
    assert list(csr.shape) == [3, 4]
    assert np.frombuffer(csr.sparse_csr.values, "<i8").tolist() == [5, 7]


def test_gateway_accepts_the_sdk_request_and_forwards_it_unchanged() -> None:
    wire = _sdk_request().SerializeToString(deterministic=True)
    submit = training.forward_backward_from_proto("owner-1", wire)
    assert submit.owner == "owner-1"
    assert submit.forward_backward.SerializeToString(deterministic=True) == wire


def test_json_form_matches_the_sdk_protobuf_form() -> None:
    """The optional JSON body becomes exactly the proto the SDK would have sent."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 0.0, 1.0]},
    )
    fb_input = types.ForwardBackwardInput(
        data=[datum], loss_fn="cross_entropy", loss_fn_config={"x": 1.5}
    )
    sdk = request_conv.forward_backward_request_to_proto(
        types.ForwardBackwardRequest(
            forward_backward_input=fb_input, model_id="m:train:0", seq_id=1
        )
    )
    body = {  # the SDK's JSON shape (tinker-protocol.md §5.1-5.2)
        "forward_backward_input": {
            "data": [
                {
                    "model_input": {"chunks": [{"tokens": [1, 2, 3], "type": "encoded_text"}]},
                    "loss_fn_inputs": {
                        "target_tokens": {"data": [2, 3, 4], "dtype": "int64", "shape": [3]},
                        "weights": {"data": [1.0, 0.0, 1.0], "dtype": "float32", "shape": [3]},
                    },
                }
            ],
            "loss_fn": "cross_entropy",
            "loss_fn_config": {"x": 1.5},
        },
        "model_id": "m:train:0",
        "seq_id": 1,
        "type": "forward_backward",
    }
    ours = training.forward_backward_from_json(
        "o", rq.ForwardBackwardJsonRequest.model_validate(body)
    )
    assert ours.forward_backward.SerializeToString(deterministic=True) == sdk.SerializeToString(
        deterministic=True
    )


def test_schema_copy_matches_the_sdk_descriptor() -> None:
    """Every message and enum of the SDK's schema exists in ours with the same fields; ours adds
    only fields numbered from 100 on (Lockstep's own, which the SDK never sends)."""
    sdk_file = tinker_public_pb2.DESCRIPTOR
    our_file = tinker_pb2.DESCRIPTOR

    def fields(d: Descriptor) -> dict[str, tuple[object, ...]]:
        return {
            f.name: (
                f.number,
                f.type,
                f.is_repeated,
                f.has_presence,
                f.message_type.name if f.message_type else None,
                f.containing_oneof.name if f.containing_oneof else None,
            )
            for f in d.fields
        }

    def values(e: EnumDescriptor) -> dict[str, int]:
        return {v.name: v.number for v in e.values}

    assert set(sdk_file.message_types_by_name) <= set(our_file.message_types_by_name)
    for name, sdk_msg in sdk_file.message_types_by_name.items():
        ours = fields(our_file.message_types_by_name[name])
        own = {k: v for k, v in ours.items() if k not in fields(sdk_msg)}
        assert all(number >= 100 for number, *_ in own.values()), (name, own)
        assert {k: v for k, v in ours.items() if k not in own} == fields(sdk_msg), name
    for name, sdk_enum in sdk_file.enum_types_by_name.items():
        assert values(our_file.enum_types_by_name[name]) == values(sdk_enum), name


def _batched(arrays: list[np.ndarray], dtype: tinker_pb2.DType) -> tinker_pb2.BatchedTensor:
    sizes = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8")
    return tinker_pb2.BatchedTensor(
        data=b"".join(a.tobytes() for a in arrays), offsets=sizes.tobytes(), dtype=dtype
    )


def test_our_forward_backward_output_decodes_with_the_sdk() -> None:
    logprobs = [np.array([-1.0, -2.0, -0.5, -0.25], "<f4"), np.array([-3.0] * 5, "<f4")]
    topk = [np.arange(6, dtype="<f4").reshape(3, 2)]
    out = tinker_pb2.ForwardBackwardOutput(
        loss_fn_output_type="lockstep:ArrayRecord",
        metrics={"loss:sum": 10.5, "clock_cycle:unique": 7.0},
    )
    record = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=2)
    record.fields["logprobs"].CopyFrom(_batched(logprobs, tinker_pb2.DTYPE_FLOAT32))
    second = out.loss_fn_outputs.add(type_tag="ArrayRecord", num_datums=1)
    second.fields["logprobs"].CopyFrom(_batched(topk, tinker_pb2.DTYPE_FLOAT32))
    second.fields["logprobs"].trailing_shape.append(2)

    decoded = response_conv.deserialize_forward_backward_output(out.SerializeToString())

    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert decoded.metrics == {"loss:sum": 10.5, "clock_cycle:unique": 7.0}
    assert [o["logprobs"].shape for o in decoded.loss_fn_outputs] == [[4], [5], [3, 2]]
    assert decoded.loss_fn_outputs[0]["logprobs"].tolist() == [-1.0, -2.0, -0.5, -0.25]
    assert decoded.loss_fn_outputs[2]["logprobs"].tolist() == [[0, 1], [2, 3], [4, 5]]


def test_our_sample_response_decodes_with_the_sdk() -> None:
    nan = float("nan")
    resp = tinker_pb2.SampleResponse(
        prompt_logprobs=np.array([nan, -2.0, -2.0], "<f4").tobytes(),
        topk_prompt_logprobs=tinker_pb2.TopkLogprobs(
            token_ids=np.array([[0, 0], [0, 1], [0, 1]], "<i4").tobytes(),
            logprobs=np.array([[-99999.0] * 2, [-1.0, -1.0], [-1.0, -1.0]], "<f4").tobytes(),
            k=2,
            length=3,
        ),
    )
    for stop in (tinker_pb2.STOP_REASON_LENGTH, tinker_pb2.STOP_REASON_STOP):
        resp.sequences.add(
            stop_reason=stop,
            tokens=np.array([100, 101, 102], "<i4").tobytes(),
            logprobs=np.array([-0.5] * 3, "<f4").tobytes(),
        )

    decoded = response_conv.deserialize_sample_response(resp.SerializeToString())

    assert [s.stop_reason for s in decoded.sequences] == ["length", "stop"]
    assert decoded.sequences[0].tokens == [100, 101, 102]
    assert decoded.sequences[1].logprobs == [-0.5, -0.5, -0.5]
    assert decoded.prompt_logprobs == [None, -2.0, -2.0]


@pytest.mark.parametrize(
    "encoding, compress",
    [
        ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)),
        ("gzip", gzip.compress),
        ("identity", lambda b: b),
    ],
)
def test_decompress_round_trip(encoding: str, compress: object) -> None:
    payload = _sdk_request().SerializeToString()
    assert callable(compress)
    assert decompress(compress(payload), encoding, limit=len(payload)) == payload


def test_decompress_limits_and_errors() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 100_000)
    with pytest.raises(BodyError) as too_big:
        decompress(bomb, "zstd", limit=99_999)
    assert too_big.value.status_code == 413
    # A frame without a content size (streaming compressor) is bounded the same way.
    streamed = zstandard.ZstdCompressor().compressobj()
    frame = streamed.compress(b"\0" * 100_000) + streamed.flush()
    with pytest.raises(BodyError):
        decompress(frame, "zstd", limit=1000)
    with pytest.raises(BodyError) as bad:
        decompress(b"not zstd", "zstd", limit=1000)
    assert bad.value.status_code == 400
    with pytest.raises(BodyError) as unknown:
        decompress(b"x", "br", limit=1000)
    assert unknown.value.status_code == 415


def test_bad_protobuf_is_a_400_naming_the_body() -> None:
    with pytest.raises(ApiError) as err:
        training.forward_backward_from_proto("o", b"\xff\xff\xff")
    assert (err.value.status_code, err.value.detail) == (
        400,
        "body: not a valid ForwardBackwardRequest",
    )


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: setattr(r, "seq_id", 0), "seq_id: must be >= 1"),
        (lambda r: setattr(r, "model_id", ""), "model_id: field required"),
        (lambda r: setattr(r, "model_id", "a/b"), "model_id: 'a/b' is not a valid id"),
    ],
)
def test_the_gateway_checks_a_requests_address(mutate: object, message: str) -> None:
    request = tinker_pb2.ForwardBackwardRequest.FromString(_sdk_request().SerializeToString())
    assert callable(mutate)
    mutate(request)
    with pytest.raises(ApiError) as err:
        training.forward_backward_from_proto("o", request.SerializeToString())
    assert err.value.status_code == 400
    assert err.value.detail.startswith(message)


def test_the_gateway_leaves_a_requests_contents_to_the_scheduler() -> None:
    """Datums, tensors and the loss are judged once, by the scheduler (test_request_rules)."""
    request = tinker_pb2.ForwardBackwardRequest.FromString(_sdk_request().SerializeToString())
    request.data[0].loss_fn_inputs["weights"].dense = b"\0" * 5
    submit = training.forward_backward_from_proto("o", request.SerializeToString())
    assert submit.forward_backward == request  # forwarded as sent


@pytest.mark.parametrize(
    ("choice", "host", "expected"),
    [
        ("auto", "127.0.0.1", False),
        ("auto", "localhost", False),
        ("auto", "::1", False),
        ("auto", "0.0.0.0", True),
        ("auto", "10.1.2.3", True),
        ("auto", "gateway.internal", True),
        ("on", "127.0.0.1", True),
        ("off", "0.0.0.0", False),
    ],
)
def test_fwdbwd_compression_is_on_by_default_off_loopback(
    choice: FwdbwdCompression, host: str, expected: bool
) -> None:
    assert compress_fwdbwd(choice, host) is expected
    cfg = LockstepConfig()
    cfg = dataclasses.replace(
        cfg,
        gateway=dataclasses.replace(
            cfg.gateway, host=host, fwdbwd_compression=choice, scheduler_address="127.0.0.1:1"
        ),
    )
    assert settings_from_config(cfg).proto_compress_fwdbwd is expected
