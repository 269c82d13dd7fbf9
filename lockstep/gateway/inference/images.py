"""Images in the compatible routes' conversations: OpenAI `image_url` parts with `data:` URIs,
Anthropic `image` blocks with base64 sources. Nothing is ever fetched: a remote URL is a 400.

The conversation is rendered with the model's own chat template, which places one image
placeholder (`<|image_pad|>` for Qwen) where each image sits; the prompt then goes to the
scheduler as chunks, text between image chunks, exactly as the tinker SDK sends an image prompt,
and the scheduler judges each image and expands its placeholder (`engine/images.py`). A template
that does not place every image (a text-only model's) is a 400, never a prompt without them.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import anthropic as an
from lockstep.gateway.schema import openai as oa
from lockstep.wire.v1 import tinker_pb2 as wire

_MEDIA = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}

# A message (or a content part) as the chat template reads it.
ChatMessage = dict[str, object]


@dataclass(frozen=True)
class ChatImage:
    data: bytes
    format: str  # png | jpeg


def _decode(field: str, media_type: str, data: str) -> ChatImage:
    fmt = _MEDIA.get(media_type.lower())
    if fmt is None:
        raise bad_request(
            field, f"media type {media_type!r} is not accepted (image/png, image/jpeg)"
        )
    try:
        return ChatImage(base64.b64decode(data, validate=True), fmt)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(field, "not valid base64") from exc


def data_uri(field: str, url: str) -> ChatImage:
    """`data:image/png;base64,...`; any other URL is refused (this server fetches nothing)."""
    if not url.startswith("data:"):
        raise bad_request(
            field, "remote image URLs are not fetched: send the image as a base64 data: URI"
        )
    head, sep, payload = url[len("data:") :].partition(",")
    media, _, encoding = head.partition(";")
    if not sep or encoding != "base64":
        raise bad_request(field, "a data: URI must be data:image/png|jpeg;base64,<data>")
    return _decode(field, media, payload)


def openai_chat(
    messages: Sequence[oa.ChatMessage],
) -> tuple[list[ChatMessage], list[ChatImage]]:
    """The chat template's messages (image parts as `{"type": "image"}`) and the images."""
    out: list[ChatMessage] = []
    images: list[ChatImage] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if not isinstance(m.content, list) or all(isinstance(p, oa.TextPart) for p in m.content):
            out.append({"role": role, "content": m.text()})
            continue
        parts: list[ChatMessage] = []
        for j, part in enumerate(m.content):
            if isinstance(part, oa.TextPart):
                parts.append({"type": "text", "text": part.text})
            else:
                field = f"messages[{i}].content[{j}].image_url.url"
                images.append(data_uri(field, part.image_url.url))
                parts.append({"type": "image"})
        out.append({"role": role, "content": parts})
    return out, images


def anthropic_chat(body: an.Conversation) -> tuple[list[ChatMessage], list[ChatImage]]:
    out: list[ChatMessage] = [{**m} for m in body.chat()[: 1 if body.system else 0]]
    images: list[ChatImage] = []
    for i, m in enumerate(body.messages):
        if not isinstance(m.content, list) or all(isinstance(b, an.TextBlock) for b in m.content):
            out.append({"role": m.role, "content": m.text()})
            continue
        parts: list[ChatMessage] = []
        for j, block in enumerate(m.content):
            if isinstance(block, an.TextBlock):
                parts.append({"type": "text", "text": block.text})
                continue
            field = f"messages[{i}].content[{j}].source"
            source = block.source
            if source.type != "base64" or source.data is None:
                raise bad_request(field, "image URLs are not fetched: send a base64 image source")
            images.append(_decode(field, source.media_type or "", source.data))
            parts.append({"type": "image"})
        out.append({"role": m.role, "content": parts})
    return out, images


def chunks(
    tokens: list[int], placeholder: int | None, images: Sequence[ChatImage]
) -> list[wire.Chunk]:
    """The rendered prompt as text and image chunks: image i at the template's i-th
    placeholder."""
    at = [k for k, t in enumerate(tokens) if t == placeholder] if placeholder is not None else []
    if len(at) != len(images):
        raise bad_request(
            "messages",
            f"the served model's chat template placed {len(at)} image(s) of {len(images)}: "
            "this model takes no images",
        )
    out: list[wire.Chunk] = []
    start = 0
    for k, image in zip(at, images, strict=True):
        if k > start:
            out.append(_text(tokens[start:k]))
        out.append(wire.Chunk(image=wire.ImageChunk(data=image.data, format=image.format)))
        start = k + 1
    if start < len(tokens):
        out.append(_text(tokens[start:]))
    return out


def _text(tokens: list[int]) -> wire.Chunk:
    data = np.asarray(tokens, dtype="<i4").tobytes()
    return wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=data))
