"""Translate between the gRPC contract messages the scheduler stores (`lockstep.v1`, with the SDK's
protobuf `lockstep.wire` inside) and the engines' internal types."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from lockstep.engine.images import ImageInput, ImageReader
from lockstep.engine.types import (
    AdamConfig,
    Datum,
    PassRequest,
    PassResult,
    SampleParams,
    SampleRequest,
    SampleResult,
)
from lockstep.errors import UserInputError
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.wire.v1 import tinker_pb2 as wire

_DTYPES: dict[int, np.dtype[Any]] = {
    wire.DTYPE_FLOAT32: np.dtype("<f4"),
    wire.DTYPE_INT64: np.dtype("<i8"),
    wire.DTYPE_INT32: np.dtype("<i4"),
}


def decode_tensor(t: wire.Tensor, field: str) -> np.ndarray:
    """A wire Tensor (dense or CSR) as a numpy array (int64 or float32)."""
    if t.dtype == wire.DTYPE_BFLOAT16:
        raise UserInputError(field, "bfloat16 tensors are not accepted; send float32")
    dtype = _DTYPES.get(t.dtype)
    if dtype is None:
        raise UserInputError(field, f"unknown dtype {t.dtype}")
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise UserInputError(field, f"negative dimension in shape {shape}")
    which = t.WhichOneof("encoding")
    if which == "sparse_csr":
        if len(shape) != 2:
            raise UserInputError(field, "sparse tensors need a 2-D shape")
        csr = t.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype="<i8")
        col = np.frombuffer(csr.col_indices, dtype="<i8")
        rows, cols = shape
        if (
            len(crow) != rows + 1
            or len(col) != len(values)
            or (len(col) and (col.min() < 0 or col.max() >= cols))
            or crow[0] != 0
            or crow[-1] != len(values)
            or np.any(np.diff(crow) < 0)
        ):
            raise UserInputError(field, "inconsistent sparse_csr indices")
        dense = np.zeros((rows, cols), dtype=dtype)
        row_of = np.repeat(np.arange(rows), np.diff(crow))
        dense[row_of, col] = values
        arr = dense
    else:
        raw = t.dense
        if len(raw) % dtype.itemsize:
            raise UserInputError(field, f"{len(raw)} bytes is not a whole number of {dtype}")
        arr = np.frombuffer(raw, dtype=dtype)
        if shape:
            if math.prod(shape) != arr.size:
                raise UserInputError(field, f"shape {shape} does not match {arr.size} elements")
            arr = arr.reshape(shape)
    if arr.dtype.kind == "f":
        return arr.astype(np.float32)
    return arr.astype(np.int64)


def _text(raw: bytes, field: str) -> np.ndarray:
    if len(raw) % 4:
        raise UserInputError(f"{field}.tokens", "not a whole number of int32 values")
    return np.frombuffer(raw, dtype="<i4")


def decode_model_input(
    chunks: Sequence[wire.Chunk], field: str, images: ImageReader
) -> tuple[np.ndarray, tuple[ImageInput, ...]]:
    """A model input's token array and its images: an image chunk becomes its token count of
    the model's image placeholder id, the image beside it (`engine/images.py` judges it)."""
    parts: list[np.ndarray] = []
    found: list[ImageInput] = []
    at = 0
    for j, chunk in enumerate(chunks):
        where = f"{field}.chunks[{j}]"
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            parts.append(_text(chunk.encoded_text.tokens, where))
            _no_placeholder(parts[-1], where, images)
        elif kind in ("image", "image_asset_pointer"):
            image = _image(chunk, where, images, at)
            found.append(image)
            assert images.spec is not None  # a reader without a spec refuses every image
            parts.append(np.full(image.tokens, images.spec.image_token_id, dtype="<i4"))
        elif kind is None:
            raise UserInputError(where, "empty chunk")
        else:
            raise UserInputError(where, f"{kind} chunks are not supported by this server")
        at += len(parts[-1])
    if not parts:
        raise UserInputError(field, "is empty")
    return np.concatenate(parts).astype(np.int64), tuple(found)


def _no_placeholder(tokens: np.ndarray, field: str, images: ImageReader) -> None:
    """The image placeholder id stands for an image chunk's embeddings; in text it would be a
    placeholder with no image (the model's own forward refuses that too)."""
    spec = images.spec
    if spec is not None and bool(np.any(tokens == spec.image_token_id)):
        raise UserInputError(
            f"{field}.tokens",
            f"token id {spec.image_token_id} is the model's image placeholder; send images as "
            "image chunks",
        )


def _image(chunk: wire.Chunk, field: str, images: ImageReader, at: int) -> ImageInput:
    if chunk.WhichOneof("chunk") == "image_asset_pointer":
        pointer = chunk.image_asset_pointer
        data = images.asset(field, pointer.location)
        expected = pointer.expected_tokens if pointer.HasField("expected_tokens") else None
        return images.image(field, data, pointer.format, expected, at)
    image = chunk.image
    if image.HasField("override_dimensions"):
        raise UserInputError(
            f"{field}.override_dimensions", "is not supported: the image is processed as sent"
        )
    expected = image.expected_tokens if image.HasField("expected_tokens") else None
    return images.image(field, image.data, image.format, expected, at)


def inline_assets(chunks: Sequence[wire.Chunk], field: str, images: ImageReader) -> None:
    """Replace each `image_asset_pointer` by an image chunk of its file's bytes, in place: what
    is stored and run later is what was judged now, even if the file changes."""
    for j, chunk in enumerate(chunks):
        if chunk.WhichOneof("chunk") != "image_asset_pointer":
            continue
        pointer = chunk.image_asset_pointer
        data = images.asset(f"{field}.chunks[{j}]", pointer.location)
        image = wire.ImageChunk(data=data, format=pointer.format)
        if pointer.HasField("expected_tokens"):
            image.expected_tokens = pointer.expected_tokens
        chunk.image.CopyFrom(image)


def loss_config(req: wire.ForwardBackwardRequest) -> dict[str, float | str]:
    config: dict[str, float | str] = {k: float(v) for k, v in req.loss_fn_config.items()}
    for key, value in req.loss_fn_config_v2.items():
        which = value.WhichOneof("value")
        if which == "number":
            config[key] = float(value.number)
        elif which == "text":
            config[key] = value.text
    return config


def pass_request(
    request_id: str, req: wire.ForwardBackwardRequest, images: ImageReader
) -> PassRequest:
    data = []
    for i, d in enumerate(req.data):
        tokens, found = decode_model_input(d.model_input, f"data[{i}].model_input", images)
        inputs = {
            k: decode_tensor(v, f"data[{i}].loss_fn_inputs.{k}")
            for k, v in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens=tokens, loss_inputs=inputs, images=found))
    return PassRequest(
        request_id=request_id,
        model_id=req.model_id,
        loss_fn=req.loss_fn,
        loss_config=loss_config(req),
        forward_only=req.forward_only,
        data=data,
    )


def pass_tokens(req: PassRequest) -> int:
    """Model-input tokens of a pass, image placeholders included (the cycle's token budget)."""
    return sum(len(d.tokens) for d in req.data)


def _batched(arrays: list[np.ndarray]) -> wire.BatchedTensor:
    first = arrays[0]
    trailing = list(first.shape[1:])
    offsets = [0]
    chunks = []
    for a in arrays:
        b = np.ascontiguousarray(a, dtype="<f4").tobytes()
        chunks.append(b)
        offsets.append(offsets[-1] + len(b))
    return wire.BatchedTensor(
        data=b"".join(chunks),
        offsets=np.asarray(offsets, dtype="<i8").tobytes(),
        dtype=wire.DTYPE_FLOAT32,
        trailing_shape=trailing,
    )


def pass_output(result: PassResult, cycle: int) -> wire.ForwardBackwardOutput:
    """Per-datum outputs as one ArrayRecord; every result of a cycle carries its cycle number."""
    record = wire.ArrayRecord(type_tag="ArrayRecord", num_datums=len(result.outputs))
    names = sorted(result.outputs[0]) if result.outputs else []
    for name in names:
        record.fields[name].CopyFrom(_batched([o[name] for o in result.outputs]))
    metrics = dict(result.metrics)
    metrics["clock_cycle:unique"] = float(cycle)
    return wire.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record], metrics=metrics
    )


def adam_config(p: pb.AdamParams) -> AdamConfig:
    return AdamConfig(
        learning_rate=p.learning_rate,
        beta1=p.beta1,
        beta2=p.beta2,
        eps=p.eps,
        weight_decay=p.weight_decay,
        grad_clip_norm=p.grad_clip_norm,
    )


def max_tokens(p: pb.SamplingParams) -> int:
    """What a sample generates at most: as asked, or the SDK's default when unset."""
    return p.max_tokens if p.HasField("max_tokens") else SampleParams.max_tokens


def sample_prompt(s: pb.Sample, images: ImageReader) -> tuple[list[int], tuple[ImageInput, ...]]:
    """A sample's prompt tokens and images (a prompt with images comes as chunks)."""
    if not s.prompt_chunks:
        return list(s.prompt_tokens), ()
    tokens, found = decode_model_input(s.prompt_chunks, "prompt", images)
    return tokens.tolist(), found


def sample_request(
    request_id: str, s: pb.Sample, adapter_id: str | None, images: ImageReader
) -> SampleRequest:
    prompt, found = sample_prompt(s, images)
    p = s.params
    stop_at_eos = not p.has_stop
    params = SampleParams(
        max_tokens=max_tokens(p),
        seed=p.seed if p.HasField("seed") else None,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        stop_strings=tuple(p.stop_strings),
        stop_tokens=tuple(p.stop_tokens),
        stop_at_eos=stop_at_eos,
    )
    return SampleRequest(
        request_id=request_id,
        adapter_id=adapter_id,
        prompt=prompt,
        images=found,
        num_samples=s.num_samples,
        params=params,
        prompt_logprobs=s.prompt_logprobs,
        topk_prompt_logprobs=s.topk_prompt_logprobs,
        topk_sample_logprobs=s.topk_sample_logprobs,
        prompt_logprobs_last_n=(
            s.prompt_logprobs_last_n if s.HasField("prompt_logprobs_last_n") else None
        ),
        # Each sampling session is its own KV-cache namespace (prefixes reused within it).
        cache_namespace=s.sampling_session_id,
    )


def _topk(rows: list[list[tuple[int, float]] | None], k: int) -> wire.TopkLogprobs:
    ids = np.zeros((len(rows), k), dtype="<i4")
    lps = np.full((len(rows), k), -99999.0, dtype="<f4")  # the SDK's "not computed" sentinel
    for i, row in enumerate(rows):
        for j, (tok, lp) in enumerate((row or [])[:k]):
            ids[i, j] = tok
            lps[i, j] = lp
    return wire.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(rows))


def sample_response(result: SampleResult, topk_prompt: int) -> wire.SampleResponse:
    out = wire.SampleResponse(prompt_cache_hit_tokens=0)
    for seq in result.sequences:
        s = out.sequences.add(
            stop_reason=wire.STOP_REASON_STOP
            if seq.stop_reason == "stop"
            else wire.STOP_REASON_LENGTH,
            tokens=np.asarray(seq.tokens, dtype="<i4").tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype="<f4").tobytes(),
        )
        if seq.topk_ids is not None and seq.topk_logprobs is not None and seq.topk_ids:
            k = len(seq.topk_ids[0])
            rows = [
                list(zip(i, lp, strict=True))
                for i, lp in zip(seq.topk_ids, seq.topk_logprobs, strict=True)
            ]
            s.topk_sampled_logprobs.CopyFrom(_topk(list(rows), k))
    if result.prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(result.prompt_logprobs, dtype="<f4").tobytes()
    if result.topk_prompt is not None and topk_prompt > 0:
        out.topk_prompt_logprobs.CopyFrom(_topk(result.topk_prompt, topk_prompt))
    return out
