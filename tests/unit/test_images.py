"""Images as the scheduler judges them (`lockstep/engine/images.py`): the token count equals
transformers' own image processor on every size, and each image the processor cannot take
exactly is refused by name before anything reaches an engine."""

from __future__ import annotations

import io
import itertools

import pytest
from PIL import Image

from lockstep.engine.images import (
    ImageLimits,
    ImageReader,
    VisionSpec,
    read_image,
)
from lockstep.errors import UserInputError

LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=1 << 22)
# The tiny models' processor (lockstep/modeling/vision/zoo.py) and the published Qwen3-VL /
# Qwen3.5 one (min 256x256, max 4096x4096 pixels).
SPECS = {
    "tiny": VisionSpec("qwen3_5", 16, 2, 2, 32 * 32, 256 * 256, 9, 7, 8),
    "published": VisionSpec("qwen3_vl", 16, 2, 2, 65536, 16777216, 9, 7, 8),
}


def encode(image: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_token_counts_equal_transformers_processor(name: str) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    spec = SPECS[name]
    processor = Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
    )
    sides = [1, 7, 16, 31, 32, 33, 48, 63, 64, 65, 100, 255, 511, 777, 1024, 3000, 5000]
    for h, w in itertools.product(sides, sides):
        if max(h, w) > 200 * min(h, w):
            continue
        patches = processor.get_number_of_image_patches(h, w, {})
        grid = spec.grid(h, w)
        assert grid[1] * grid[2] == patches, (h, w)
        assert spec.tokens(grid) == patches // spec.merge_size**2
    # And the grid the processor really produces from pixels.
    for h, w in [(48, 64), (33, 97), (200, 31)]:
        out = processor(images=[Image.new("RGB", (w, h), (9, 99, 199))], return_tensors="np")
        assert tuple(out["image_grid_thw"][0]) == spec.grid(h, w)


def _refused(data: bytes, fmt: str = "png", limits: ImageLimits = LIMITS) -> str:
    with pytest.raises(UserInputError) as info:
        read_image(data, fmt, "data[0].model_input.chunks[1]", limits)
    return str(info.value)


def test_accepted_modes_decode() -> None:
    base = Image.new("RGB", (40, 30), (200, 10, 10))
    for image, fmt in [
        (base, "png"),
        (base.convert("RGBA"), "png"),
        (base.convert("L"), "png"),
        (base.convert("LA"), "png"),
        (base.convert("P"), "png"),
        (base.convert("1"), "png"),
        (base, "jpeg"),
        (base.convert("CMYK"), "jpeg"),
        (base.convert("L"), "jpeg"),
    ]:
        assert read_image(encode(image, fmt.upper()), fmt, "f", LIMITS) == (30, 40)


def test_each_bad_image_is_refused_by_name() -> None:
    rgb = Image.new("RGB", (64, 64), (0, 128, 255))
    png = encode(rgb)
    field = "data[0].model_input.chunks[1]"
    big = ImageLimits(max_bytes=len(png) - 1, max_pixels=1 << 22)
    assert f"{field}: the image is {len(png)} bytes" in _refused(png, limits=big)
    assert "max_image_bytes" in _refused(png, limits=big)
    assert f"{field}.format: 'gif' is not an image format" in _refused(png, "gif")
    assert f"{field}.format: says jpeg but the data is a PNG image" in _refused(png, "jpeg")
    assert f"{field}.data: is not a PNG or JPEG image" in _refused(b"GIF89a" + b"\0" * 64)
    assert f"{field}.data: is empty" in _refused(b"")
    few = ImageLimits(max_bytes=1 << 20, max_pixels=64 * 64 - 1)
    assert "64x64 = 4096 pixels" in _refused(png, limits=few)
    assert f"{field}.data: is a truncated or corrupt png" in _refused(png[: len(png) // 2])
    corrupt = bytearray(png)
    corrupt[60] ^= 0xFF
    assert "truncated or corrupt" in _refused(bytes(corrupt))
    animated = encode(rgb, save_all=True, append_images=[Image.new("RGB", (64, 64))])
    assert "animated image (2 frames)" in _refused(animated)
    assert "I;16 image (16-bit" in _refused(encode(Image.new("I;16", (8, 8))))
    assert "aspect ratio" in _refused(encode(Image.new("RGB", (402, 2))))


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    """PNGs that claim 12000 x 12000 and 30000 x 30000 pixels (a few KB compressed): refused
    before decoding (the second past Pillow's own bound too)."""
    limits = ImageLimits(max_bytes=1 << 20, max_pixels=40_000_000)
    bomb = encode(Image.new("1", (12000, 12000)))
    assert len(bomb) < 50_000
    assert "12000x12000 = 144000000 pixels" in _refused(bomb, limits=limits)
    bigger = encode(Image.new("1", (30000, 30000)))
    assert "more than 40000000 pixels (max_image_pixels)" in _refused(bigger, limits=limits)


def test_expected_tokens_mismatch_gives_both_numbers() -> None:
    reader = ImageReader(SPECS["tiny"], LIMITS)
    png = encode(Image.new("RGB", (64, 64)))
    image = reader.image("c", png, "png", 4, position=3)
    assert (image.position, image.tokens, image.grid) == (3, 4, (1, 4, 4))
    with pytest.raises(UserInputError) as info:
        reader.image("c", png, "png", 5, position=3)
    assert str(info.value).startswith("c.expected_tokens: is 5 but this image is 4 tokens")


def test_a_text_only_reader_refuses_images() -> None:
    reader = ImageReader(None, LIMITS)
    with pytest.raises(UserInputError, match="serves a text-only model"):
        reader.image("c", encode(Image.new("RGB", (8, 8))), "png", None, 0)
