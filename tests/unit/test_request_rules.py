"""A forward_backward's contents are judged once, by the scheduler's decoding and validation
(`translate.pass_request` + `losses.validate_pass_request`, what `Submissions` runs): each rule
names the offending field. The gateway checks only the request's address (test_gateway_codec)."""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from lockstep.engine import losses
from lockstep.engine.images import ImageLimits, ImageReader, VisionSpec
from lockstep.engine.types import PassRequest
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


TEXT_ONLY = ImageReader(None, ImageLimits(1 << 20, 1 << 22))
VLM = VisionSpec("qwen3_5", 16, 2, 2, 32 * 32, 256 * 256, 90, 91, 92)


def _judge(req: tinker_pb2.ForwardBackwardRequest, images: ImageReader = TEXT_ONLY) -> PassRequest:
    decoded = translate.pass_request("x", req, images)
    losses.validate_pass_request(decoded, vocab_size=100, max_context=64)
    return decoded


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


def _png(width: int = 64, height: int = 64) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (30, 60, 90)).save(out, format="PNG")
    return out.getvalue()


def _with_image(
    expected: int | None = 4, data: bytes | None = None
) -> tinker_pb2.ForwardBackwardRequest:
    """[1, 2, 3] + a 64x64 image (4 tokens for VLM) + [5]: 8 positions, 8 targets."""
    req = _request()
    datum = req.data[0]
    image = datum.model_input.add().image
    image.data, image.format = (_png() if data is None else data), "png"
    if expected is not None:
        image.expected_tokens = expected
    datum.model_input.add().encoded_text.tokens = (5).to_bytes(4, "little")
    target = datum.loss_fn_inputs["target_tokens"]
    target.dense = b"".join(t.to_bytes(8, "little") for t in range(8))
    datum.loss_fn_inputs["weights"].dense = b"\0\0\x80\x3f" * 8
    datum.loss_fn_inputs["weights"].shape[:] = [8]
    return req


def test_an_image_chunk_of_a_text_only_model_is_refused_by_name() -> None:
    with pytest.raises(UserInputError) as err:
        _judge(_with_image())
    assert str(err.value) == (
        "data[0].model_input.chunks[1]: image chunks are not supported: this server serves a "
        "text-only model"
    )


def test_an_image_becomes_its_placeholder_tokens() -> None:
    reader = ImageReader(VLM, ImageLimits(1 << 20, 1 << 22))
    datum = _judge(_with_image(), reader).data[0]
    assert datum.tokens.tolist() == [1, 2, 3, 90, 90, 90, 90, 5]
    (image,) = datum.images
    assert (image.position, image.tokens, image.grid, image.data) == (3, 4, (1, 4, 4), _png())
    # expected_tokens is advisory: without it the server's own count is used.
    assert len(_judge(_with_image(expected=None), reader).data[0].tokens) == 8


@pytest.mark.parametrize(
    "req, message",
    [
        (
            _with_image(expected=5),
            "data[0].model_input.chunks[1].expected_tokens: is 5 but this image is 4 tokens",
        ),
        (_with_image(data=_png()[:-30]), "data[0].model_input.chunks[1].data: is a truncated"),
        (_with_image(data=b"nope"), "data[0].model_input.chunks[1].data: is not a PNG or JPEG"),
    ],
)
def test_each_bad_image_names_its_chunk(
    req: tinker_pb2.ForwardBackwardRequest, message: str
) -> None:
    with pytest.raises(UserInputError) as err:
        _judge(req, ImageReader(VLM, ImageLimits(1 << 20, 1 << 22)))
    assert str(err.value).startswith(message), str(err.value)


def test_the_placeholder_id_in_text_is_refused() -> None:
    req = _request()
    req.data[0].model_input[0].encoded_text.tokens = b"".join(
        t.to_bytes(4, "little") for t in (1, 90, 3)
    )
    with pytest.raises(UserInputError) as err:
        _judge(req, ImageReader(VLM, ImageLimits(1 << 20, 1 << 22)))
    assert str(err.value).startswith(
        "data[0].model_input.chunks[0].tokens: token id 90 is the model's image placeholder"
    )


def _pointer(location: str) -> tinker_pb2.ForwardBackwardRequest:
    req = _with_image()
    req.data[0].model_input[1].image_asset_pointer.CopyFrom(
        tinker_pb2.ImageAssetPointerChunk(format="png", location=location, expected_tokens=4)
    )
    return req


def test_asset_pointers_read_only_the_operators_directory(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.png").write_bytes(_png())
    (tmp_path / "secret.png").write_bytes(_png())
    limits = ImageLimits(1 << 20, 1 << 22)
    field = "data[0].model_input.chunks[1]"
    with pytest.raises(
        UserInputError, match=f"{re.escape(field)}: image_asset_pointer chunks are not accepted"
    ):
        _judge(_pointer("a.png"), ImageReader(VLM, limits))
    allowed = ImageReader(VLM, limits, tmp_path / "images")
    for location, message in [
        ("http://example.com/a.png", "is a URL; this server never fetches images"),
        ("../secret.png", "is not a file under the image directory"),
        ("missing.png", "is not a file under the image directory"),
    ]:
        with pytest.raises(UserInputError) as err:
            _judge(_pointer(location), allowed)
        assert str(err.value) == f"{field}.location: " + message or message in str(err.value)
    req = _pointer("a.png")
    translate.inline_assets(req.data[0].model_input, "data[0].model_input", allowed)
    assert req.data[0].model_input[1].image.data == _png()  # what is stored is what was judged
    assert _judge(req, allowed).data[0].images[0].data == _png()
