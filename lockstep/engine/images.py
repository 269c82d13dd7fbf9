"""Images in a model input: what the served model's image processor does with them, how many
tokens each becomes, and the one place an image's bytes are judged.

A vision-language model's image chunk becomes `tokens` copies of the model's image placeholder
id in the token array (what HF's processor expands `<|image_pad|>` to), and the image itself
travels beside the tokens (`ImageInput`) to the engine, which runs the vision tower and puts
its embeddings at those positions.

The scheduler judges every image once, at submission (`read_image`): its encoded size, its
format, its pixel count from the header before anything is decoded (decompression bombs), a
full decode (truncated and corrupt files), the modes and frames the processor cannot take, and
its token count against the chunk's `expected_tokens`. The count follows the model's own image
processor (`preprocessor_config.json`): Qwen's smart resize to whole merged patches within the
processor's pixel range (`VisionSpec.resized`; equal to transformers' processor on every size,
tests/unit/test_images.py). Pure Python and Pillow: the scheduler imports no torch for it.

What crosses the engine pipe is the encoded image (`ImageInput.data`), not pixels: a 64x64 JPEG
is ~1 KB where its fp32 patches are ~100 KB (a megapixel image: ~200 KB vs ~25 MB), and a pass
or a sample is pickled whole into the engine process and kept decoded by the scheduler until it
runs. The engine decodes and processes it with the model's processor itself
(`lockstep/modeling/vision/processing.py`).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import warnings
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

from PIL import Image, UnidentifiedImageError

from lockstep.engine.families import ModelConfig
from lockstep.errors import UserInputError
from lockstep.vocab import InputKind

log = logging.getLogger(__name__)
TEXT_ONLY = "image chunks are not supported: this server serves a text-only model"
MAX_ASPECT = 200  # the processor refuses a longer side over 200 times the shorter
_HIGH_BIT_MODES = frozenset({"I", "I;16", "I;16B", "I;16L", "I;16N", "F"})


class ImageFormat(StrEnum):
    PNG = "png"
    JPEG = "jpeg"


_PIL_FORMAT = {ImageFormat.PNG: "PNG", ImageFormat.JPEG: "JPEG"}


@dataclass(frozen=True)
class VisionSpec:
    """The served model's image processing, from its `preprocessor_config.json` and
    `config.json`: what the scheduler needs to count an image's tokens and place them."""

    model_type: str
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int
    vision_start_token_id: int | None
    vision_end_token_id: int | None

    @classmethod
    def of(cls, model: ModelConfig) -> VisionSpec | None:
        """The spec of a model directory, or None: not a vision-language model Lockstep
        serves images for (its text still trains). Which families those are is the family
        table's (`families.IMAGES`: Qwen-style processors, each tested against transformers'
        ForConditionalGeneration forward)."""
        config, directory = model.settings, model.directory
        model_type = model.family.model_type
        path = directory / "preprocessor_config.json"
        if not model.family.images or not config.get("vision_config"):
            return None
        vocab = int(model.text["vocab_size"])
        image_token = config.get("image_token_id")
        if not path.is_file() or not isinstance(image_token, int) or not 0 <= image_token < vocab:
            log.warning(
                "%s: a %s vision-language checkpoint without its image processor's "
                "preprocessor_config.json or an image token in its vocabulary: served as text "
                "only (image chunks are refused)",
                directory,
                model_type,
            )
            return None
        pre = json.loads(path.read_text())
        size = pre.get("size") or {}
        vision = config["vision_config"]
        return cls(
            model_type=model_type,
            patch_size=int(pre.get("patch_size") or vision["patch_size"]),
            merge_size=int(pre.get("merge_size") or vision["spatial_merge_size"]),
            temporal_patch_size=int(
                pre.get("temporal_patch_size") or vision.get("temporal_patch_size", 2)
            ),
            min_pixels=int(pre.get("min_pixels") or size["shortest_edge"]),
            max_pixels=int(pre.get("max_pixels") or size["longest_edge"]),
            image_token_id=int(config["image_token_id"]),
            vision_start_token_id=_optional_int(config.get("vision_start_token_id")),
            vision_end_token_id=_optional_int(config.get("vision_end_token_id")),
        )

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after the processor's resize: each a multiple of patch x merge, the
        area within [min_pixels, max_pixels], the aspect ratio kept as closely as it can be."""
        factor = self.patch_size * self.merge_size
        h_bar = round(height / factor) * factor
        w_bar = round(width / factor) * factor
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar = math.ceil(height * beta / factor) * factor
            w_bar = math.ceil(width * beta / factor) * factor
        return h_bar, w_bar

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """(t, h, w) in patches, as `image_grid_thw` gives it (one frame for an image)."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, grid: tuple[int, int, int]) -> int:
        """Placeholder tokens of an image of this grid: its patches merged merge x merge."""
        t, h, w = grid
        return t * h * w // (self.merge_size * self.merge_size)


@dataclass(frozen=True)
class ImageInput:
    """One image of a datum or a prompt, as the engine gets it: its placeholders are
    `tokens` positions from `position` on in the token array."""

    position: int
    tokens: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    data: bytes  # the encoded PNG or JPEG, as sent

    @property
    def digest(self) -> bytes:
        """What the image is, for caches keyed by content (the sampler's prefix cache)."""
        return hashlib.sha256(self.data).digest()


@dataclass(frozen=True)
class ImageLimits:
    """The operator's bounds on one image (`Limits`: --max-image-bytes, --max-image-pixels)."""

    max_bytes: int
    max_pixels: int


# For payloads judged at their submission and run again (a replay, the sampling lane): their
# images passed the operator's limits then, whatever the limits are now.
RUN_AGAIN = ImageLimits(max_bytes=1 << 62, max_pixels=1 << 62)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def read_image(
    data: bytes, declared: str, field: str, limits: ImageLimits, decode: bool = True
) -> tuple[int, int]:
    """(height, width) of an encoded image, judged: a UserInputError naming `field` and what
    is wrong for anything the model's processor cannot take exactly. `decode=False` reads the
    header only (for bytes judged before, e.g. a stored payload being run)."""
    if len(data) > limits.max_bytes:
        raise UserInputError(
            field,
            f"the image is {len(data)} bytes; this server accepts at most {limits.max_bytes} "
            "(max_image_bytes)",
        )
    try:
        fmt = ImageFormat(declared)
    except ValueError:
        raise UserInputError(
            f"{field}.format", f"{declared!r} is not an image format this server reads (png, jpeg)"
        ) from None
    if not data:
        raise UserInputError(f"{field}.data", "is empty")
    with warnings.catch_warnings():
        # Pillow warns past its own pixel bound; ours below is stricter and gives a 400.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=list(_PIL_FORMAT.values()))
        except UnidentifiedImageError:
            raise UserInputError(f"{field}.data", "is not a PNG or JPEG image") from None
        except Image.DecompressionBombError as exc:  # Pillow's own bound, past ours
            raise UserInputError(
                field,
                f"the image has more than {limits.max_pixels} pixels (max_image_pixels): {exc}",
            ) from None
        except (OSError, SyntaxError, ValueError) as exc:
            raise UserInputError(f"{field}.data", f"is not a readable image: {exc}") from None
        with image:
            return _judge(image, fmt, field, limits, decode)


def _judge(
    image: Image.Image, fmt: ImageFormat, field: str, limits: ImageLimits, decode: bool
) -> tuple[int, int]:
    if image.format != _PIL_FORMAT[fmt]:
        raise UserInputError(
            f"{field}.format", f"says {fmt.value} but the data is a {image.format} image"
        )
    width, height = image.size
    if width < 1 or height < 1:
        raise UserInputError(f"{field}.data", f"has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:  # from the header: nothing decoded yet
        raise UserInputError(
            field,
            f"the image is {width}x{height} = {width * height} pixels; this server accepts at "
            f"most {limits.max_pixels} (max_image_pixels)",
        )
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise UserInputError(
            field, f"the image is {width}x{height}: its aspect ratio must be under {MAX_ASPECT}"
        )
    frames = int(getattr(image, "n_frames", 1))
    if frames > 1:
        raise UserInputError(
            field, f"is an animated image ({frames} frames); send one frame as a still image"
        )
    if image.mode in _HIGH_BIT_MODES:
        raise UserInputError(
            field,
            f"is a {image.mode} image (16-bit or float samples); the image processor reads 8-bit "
            "samples: convert it to 8-bit RGB or grayscale",
        )
    if decode:
        try:
            image.load()  # every pixel: truncated and corrupt data fail here, not in the engine
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise UserInputError(
                f"{field}.data", f"is a truncated or corrupt {fmt.value} image: {exc}"
            ) from None
    return height, width


def check_expected(
    field: str, expected: int | None, tokens: int, size: tuple[int, int], spec: VisionSpec
) -> None:
    """The chunk's `expected_tokens` (advisory in the SDK) against the processor's count."""
    if expected is None or expected == tokens:
        return
    height, width = size
    h, w = spec.resized(height, width)
    raise UserInputError(
        f"{field}.expected_tokens",
        f"is {expected} but this image is {tokens} tokens for this model ({width}x{height} "
        f"pixels resized to {w}x{h}: patches of {spec.patch_size}, merged "
        f"{spec.merge_size}x{spec.merge_size})",
    )


class TakesInput(Protocol):
    """An engine's capabilities (`engine/capabilities.py`): the one judge of what it takes."""

    def check_input(self, kind: InputKind, field: str) -> None: ...


@dataclass(frozen=True)
class ImageReader:
    """Turns image chunks into placeholder tokens and `ImageInput`s for one served model.

    `spec` None: the model takes no images, and every image chunk is refused by name. `engine`:
    the capabilities of the engine the images go to, asked of every image chunk (None: a
    payload admitted before, run again). `asset_dir`: the one local directory an
    `image_asset_pointer` chunk may name (--image-dir); None refuses them. `decode`: judge
    every pixel (submission) or read headers only (a payload judged at its submission, run
    again later)."""

    spec: VisionSpec | None
    limits: ImageLimits
    asset_dir: Path | None = None
    decode: bool = True
    engine: TakesInput | None = None

    def _spec(self, field: str) -> VisionSpec:
        """The model's image processing, if it and the engine take images at all."""
        if self.spec is None:
            raise UserInputError(field, TEXT_ONLY)
        if self.engine is not None:
            self.engine.check_input(InputKind.IMAGE, field)
        return self.spec

    def image(
        self, field: str, data: bytes, fmt: str, expected: int | None, position: int
    ) -> ImageInput:
        spec = self._spec(field)
        size = read_image(data, fmt, field, self.limits, self.decode)
        grid = spec.grid(*size)
        tokens = spec.tokens(grid)
        check_expected(field, expected, tokens, size, spec)
        return ImageInput(position=position, tokens=tokens, grid=grid, data=data)

    def asset(self, field: str, location: str) -> bytes:
        """The bytes of an `image_asset_pointer`'s file: only a file under the operator's
        directory, never a URL (nothing is ever fetched)."""
        self._spec(field)
        if self.asset_dir is None:
            raise UserInputError(
                field,
                "image_asset_pointer chunks are not accepted: this server reads no image files "
                "(its operator may allow one local directory with --image-dir); send the image "
                "bytes in an image chunk",
            )
        if "://" in location:
            raise UserInputError(
                f"{field}.location", "is a URL; this server never fetches images: send the bytes"
            )
        root = self.asset_dir.resolve()
        path = (root / location).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise UserInputError(
                f"{field}.location", f"{location!r} is not a file under the image directory"
            )
        if path.stat().st_size > self.limits.max_bytes:
            raise UserInputError(
                field,
                f"the image file is {path.stat().st_size} bytes; this server accepts at most "
                f"{self.limits.max_bytes} (max_image_bytes)",
            )
        return path.read_bytes()
