"""A JSON model input's chunks as the SDK's protobuf chunks (what the scheduler judges).

The gateway only converts: base64 is decoded and token ids must fit int32; what an image is,
and whether the served model takes it, is the scheduler's to judge (`engine/images.py`).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

from lockstep.gateway.errors import bad_request
from lockstep.gateway.schema import requests as rq
from lockstep.wire.v1 import tinker_pb2


def b64(field: str, text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise bad_request(field, "not valid base64") from e


def wire_chunk(field: str, chunk: rq.Chunk) -> tinker_pb2.Chunk:
    if isinstance(chunk, rq.EncodedTextChunk):
        try:
            tokens = np.asarray(chunk.tokens, dtype="<i4").tobytes()
        except OverflowError as e:
            raise bad_request(f"{field}.tokens", "token ids must fit int32") from e
        return tinker_pb2.Chunk(encoded_text=tinker_pb2.EncodedTextChunk(tokens=tokens))
    if isinstance(chunk, rq.ImageChunk):
        image = tinker_pb2.ImageChunk(data=b64(f"{field}.data", chunk.data), format=chunk.format)
        if chunk.expected_tokens is not None:
            image.expected_tokens = chunk.expected_tokens
        return tinker_pb2.Chunk(image=image)
    if isinstance(chunk, rq.ImageAssetPointerChunk):
        pointer = tinker_pb2.ImageAssetPointerChunk(format=chunk.format, location=chunk.location)
        if chunk.expected_tokens is not None:
            pointer.expected_tokens = chunk.expected_tokens
        return tinker_pb2.Chunk(image_asset_pointer=pointer)
    return tinker_pb2.Chunk(dmel=tinker_pb2.DmelChunk(dmel=b64(f"{field}.dmel", chunk.dmel)))


def has_images(chunks: list[rq.Chunk]) -> bool:
    return any(isinstance(c, rq.ImageChunk | rq.ImageAssetPointerChunk) for c in chunks)
