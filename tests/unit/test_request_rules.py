"""One rule set per op: what a request carries is judged once, by its scheduler op's `admit`
(`scheduler/ops/`), and each rule below is named once, with the message that names its field.

The gateway checks a request's address (ids, seq_id) and refuses only what the contract cannot
carry (the last table); every other request reaches the scheduler as the client sent it, and
the engines trust what was admitted. forward_backward's contents are judged while the scheduler
decodes them (`translate.pass_request` + `losses.validate_pass_request`)."""

from __future__ import annotations

import asyncio
import io
import json
import math
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from PIL import Image

from lockstep.config import Limits
from lockstep.custom_loss.bound import CostBound
from lockstep.engine import losses
from lockstep.engine.capabilities import (
    TEXT_AND_IMAGES,
    Engines,
    SamplerCapabilities,
    TrainerCapabilities,
)
from lockstep.engine.images import ImageLimits, ImageReader, VisionSpec
from lockstep.engine.types import NO_MEMORY_LIMIT, ModelCard, PassRequest
from lockstep.errors import UserInputError
from lockstep.gateway.errors import ApiError
from lockstep.gateway.ops import registry as gateway_ops
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.translate import sampling
from lockstep.paths import TinkerPath, checkpoint_dir
from lockstep.scheduler import translate
from lockstep.scheduler.ops import registry
from lockstep.scheduler.ops.base import SubmitContext
from lockstep.scheduler.state.catalog import Catalog
from lockstep.scheduler.state.custom_losses import CustomLosses
from lockstep.scheduler.state.records import (
    CheckpointRecord,
    LoraRecord,
    ModelRecord,
    SamplerRecord,
    SessionRecord,
)
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import CheckpointType
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


# ---------------------------------------------------------------- every other op
OWNER = "rules-owner"
SESSION = "sess-rules"
MODEL = f"{SESSION}:train:0"
SAMPLER = f"{SESSION}:sample:0"
CARD = ModelCard(
    name="tiny",
    directory="/nowhere",
    arch="llama",
    vocab_size=100,
    max_context_length=64,
    eos_token_id=None,
)
CHECKPOINT = f"tinker://{MODEL}/weights/ck"
TEXT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
BODIES: dict[str, dict[str, Any]] = {  # a valid request of each op, as the SDK sends it
    "create_model": {
        "session_id": SESSION,
        "model_seq_id": 1,
        "base_model": "tiny",
        "lora_config": {"rank": 4},
    },
    "optim_step": {"model_id": MODEL, "seq_id": 1, "adam_params": {"learning_rate": 1e-4}},
    "save_weights": {"model_id": MODEL, "seq_id": 1, "path": "ckpt", "ttl_seconds": 3600},
    "save_weights_for_sampler": {"model_id": MODEL, "seq_id": 1, "sampling_session_seq_id": 0},
    "save_weights_external": {"model_id": MODEL, "seq_id": 1, "path": "ext"},
    "load_weights": {"session_id": SESSION, "model_seq_id": 2, "path": CHECKPOINT},
    "asample": {
        "sampling_session_id": SAMPLER,
        "seq_id": 0,
        "prompt": TEXT,
        "sampling_params": {"max_tokens": 4},
    },
}


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set (or, with DROP, remove) the body field at a dotted path."""

    def mutate(body: Any) -> None:
        *parents, last = path.split(".")
        for name in parents:
            body = body[int(name)] if isinstance(body, list) else body[name]
        if value is DROP:
            body.pop(last, None)
        else:
            body[last] = value

    return mutate


DROP = object()
OPS = {op.name: op for op in gateway_ops.ops()}
# (op, mutation of its valid body, the scheduler's message): each rule once.
RULES = [
    ("create_model", _set("lora_config.rank", 0), "lora_config.rank: must be in [1, "),
    (
        "create_model",
        _set(
            "lora_config",
            {"rank": 4, "train_mlp": False, "train_attn": False, "train_unembed": False},
        ),
        "lora_config: at least one of train_mlp, train_attn, train_unembed must be true",
    ),
    ("create_model", _set("model_seq_id", -1), "model_seq_id: must be >= 0"),
    ("create_model", _set("base_model", "other"), "base_model: 'other' is not served here"),
    (
        "create_model",
        _set("optimizer_config", {"type": "dimuon"}),
        "optimizer_config.type: optimizer 'dimuon' is not supported",
    ),
    ("optim_step", _set("adam_params", DROP), "adam_params: field required"),
    (
        "optim_step",
        _set("adam_params.learning_rate", -1.0),
        "adam_params.learning_rate: must be >=",
    ),
    ("optim_step", _set("adam_params.beta1", 1.0), "adam_params.beta1: must be < 1"),
    ("optim_step", _set("adam_params.beta2", -0.5), "adam_params.beta2: must be >="),
    ("optim_step", _set("adam_params.eps", -1.0), "adam_params.eps: must be >="),
    ("optim_step", _set("adam_params.weight_decay", -1.0), "adam_params.weight_decay: must be >="),
    (
        "optim_step",
        _set("adam_params.grad_clip_norm", math.inf),
        "adam_params.grad_clip_norm: must be a finite number",
    ),
    ("save_weights", _set("path", DROP), "path: field required"),
    ("save_weights", _set("path", "a/b"), "path: 'a/b' is not a valid checkpoint name"),
    ("save_weights", _set("ttl_seconds", 0), "ttl_seconds: must be positive"),
    (
        "save_weights_for_sampler",
        _set("sampling_session_seq_id", DROP),
        "path: give a name (path) or a sampling_session_seq_id",
    ),
    (
        "save_weights_for_sampler",
        _set("sampling_session_seq_id", -1),
        "sampling_session_seq_id: must be >= 0",
    ),
    (
        "save_weights_external",
        _set("age_encryption_recipients", ["age1nope"]),
        "age_encryption_recipients[0]",
    ),
    ("load_weights", _set("path", "nope"), "path: 'nope' is not a tinker:// path"),
    (
        "load_weights",
        _set("path", f"tinker://{MODEL}/sampler_weights/ck"),
        "path: load_state needs a training checkpoint",
    ),
    ("load_weights", _set("model_seq_id", -1), "model_seq_id: must be >= 0"),
    ("asample", _set("prompt.chunks.0.tokens", []), "prompt: must contain at least one token"),
    ("asample", _set("prompt.chunks.0.tokens", [1, 2, 105]), "prompt.tokens[2]: token id 105"),
    ("asample", _set("prompt.chunks.0.tokens", [-1]), "prompt.tokens[0]: token id -1"),
    ("asample", _set("num_samples", 0), "num_samples: must be in [1, "),
    ("asample", _set("sampling_params.max_tokens", 0), "sampling_params.max_tokens: must be >= 1"),
    (
        "asample",
        _set("sampling_params.max_tokens", 62),
        "sampling_params.max_tokens: prompt (3) + max_tokens (62) exceeds the context length 64",
    ),
    ("asample", _set("sampling_params.temperature", -1.0), "sampling_params.temperature: must be"),
    ("asample", _set("sampling_params.top_p", 0.0), "sampling_params.top_p: must be in (0, 1]"),
    ("asample", _set("sampling_params.top_p", math.nan), "sampling_params.top_p: must be a finite"),
    ("asample", _set("sampling_params.top_k", -2), "sampling_params.top_k: must be -1 or >= 0"),
    ("asample", _set("sampling_params.stop", [-1]), "sampling_params.stop: token id -1"),
    ("asample", _set("topk_prompt_logprobs", -1), "topk_prompt_logprobs: must be in [0, 100]"),
    ("asample", _set("topk_sample_logprobs", 101), "topk_sample_logprobs: must be in [0, 100]"),
    (
        "asample",
        _set("prompt_logprobs_last_n", 1),
        "prompt_logprobs_last_n: requires prompt_logprobs",
    ),
]


def _body(op: str, mutate: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    body = json.loads(json.dumps(BODIES[op]))
    if mutate is not None:
        mutate(body)
    return body


async def _submit_request(op: str, body: dict[str, Any]) -> pb.SubmitRequest:
    """What the gateway sends the scheduler for `body` (it refuses nothing of the rules)."""
    gateway = OPS[op]
    assert gateway.body is not None
    return await gateway.submit_request(OWNER, gateway.body.model_validate(body))


LOCAL = Engines(TrainerCapabilities("local", custom_loss=True), SamplerCapabilities("local"))


async def _context(url: str, data: Path, engines: Engines = LOCAL) -> SubmitContext:
    """A real store with a live session, a training run, a sampler and a checkpoint on disk."""
    store = Store.from_url(url)
    now = time.time()
    await store.sessions.create(SessionRecord(SESSION, OWNER, now, now))
    await store.runs.put(ModelRecord(MODEL, OWNER, SESSION, "tiny", LoraRecord(rank=4), now, now))
    await store.samplers.put(SamplerRecord(SAMPLER, OWNER, SESSION, "tiny"))
    path = TinkerPath.parse(CHECKPOINT)
    directory = checkpoint_dir(data, path)
    directory.mkdir(parents=True)
    await store.checkpoints.put(
        MODEL,
        CheckpointRecord(
            path.checkpoint_id, CheckpointType.TRAINING, CHECKPOINT, str(directory), now
        ),
    )
    catalog = Catalog(store, CARD, ["tiny"], data)
    bound = CostBound.for_model(CARD, NO_MEMORY_LIMIT)
    losses_ = CustomLosses(store, catalog, bound, CARD.max_context_length, engines.trainer)
    return SubmitContext(
        store,
        catalog,
        CARD,
        Limits(),
        NO_MEMORY_LIMIT,
        data,
        losses_,
        TEXT_ONLY,
        engines,
        TEXT_ONLY,
    )


async def _admit(url: str, data: Path, req: pb.SubmitRequest, engines: Engines = LOCAL) -> object:
    ctx = await _context(url, data, engines)
    try:
        return await registry.arriving_as(req.WhichOneof("op")).admit(ctx, req)
    finally:
        await ctx.store.close()


def test_each_ops_valid_request_is_admitted(clean_redis: str, tmp_path: Path) -> None:
    for op in BODIES:
        req = asyncio.run(_submit_request(op, _body(op)))
        redis.Redis.from_url(clean_redis).flushdb()
        shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
        assert asyncio.run(_admit(clean_redis, tmp_path, req)) is not None, op


@pytest.mark.parametrize(
    "op, mutate, message", RULES, ids=[f"{op}:{message.split(':')[0]}" for op, _, message in RULES]
)
def test_each_rule_is_the_schedulers(
    op: str,
    mutate: Callable[[dict[str, Any]], None],
    message: str,
    clean_redis: str,
    tmp_path: Path,
) -> None:
    req = asyncio.run(_submit_request(op, _body(op, mutate)))  # the gateway passes it on
    with pytest.raises(UserInputError) as err:
        asyncio.run(_admit(clean_redis, tmp_path, req))
    assert str(err.value).startswith(message), str(err.value)


def test_what_the_engines_do_not_run_is_refused_naming_the_engine(
    clean_redis: str, tmp_path: Path
) -> None:
    """The engines' capabilities are rules too, judged at admission: a server-side custom loss
    where the training engine runs none (Megatron), and images for an engine that does not run
    the model's vision tower."""
    megatron = Engines(TrainerCapabilities("megatron"), SamplerCapabilities("vllm"))
    fb = _request()
    fb.model_id, fb.loss_fn = MODEL, "custom"
    fb.loss_fn_config_v2["loss_id"].text = f"{SESSION}:loss:0"
    req = pb.SubmitRequest(owner=OWNER, forward_backward=fb)
    with pytest.raises(UserInputError) as err:
        asyncio.run(_admit(clean_redis, tmp_path / "fb", req, megatron))
    assert str(err.value).startswith(
        "loss_fn: server-side custom losses do not run on the megatron training engine"
    ), str(err.value)

    async def create() -> None:
        ctx = await _context(clean_redis, tmp_path / "create", megatron)
        try:
            await ctx.custom_losses.create(
                pb.CreateCustomLossRequest(owner=OWNER, session_id=SESSION, name="l")
            )
        finally:
            await ctx.store.close()

    with pytest.raises(UserInputError) as err:
        asyncio.run(create())
    assert "do not run on the megatron training engine" in str(err.value)

    # Images: the reader of each engine asks its capabilities (Submissions builds them so).
    limits = ImageLimits(1 << 20, 1 << 22)
    vlm_sampler = SamplerCapabilities("local", inputs=TEXT_AND_IMAGES)
    assert len(_judge(_with_image(), ImageReader(VLM, limits, engine=vlm_sampler)).data[0].images)
    for engine, who in (
        (SamplerCapabilities("vllm"), "the vllm sampler"),
        (TrainerCapabilities("megatron"), "the megatron training engine"),
    ):
        with pytest.raises(UserInputError) as err:
            _judge(_with_image(), ImageReader(VLM, limits, engine=engine))
        message = f"image chunks are not supported by {who}"
        assert str(err.value) == f"data[0].model_input.chunks[1]: {message}"
    # A text-only model says so, whatever the engine.
    text_only = ImageReader(None, limits, engine=vlm_sampler)
    with pytest.raises(UserInputError, match="this server serves a text-only model"):
        _judge(_with_image(), text_only)


@pytest.mark.parametrize(
    "op, mutate, field",
    [
        ("optim_step", None, "adam_params"),
        ("create_model", None, "optimizer_config.type"),
        ("load_weights", _set("optimizer", True), "optimizer"),
    ],
)
def test_an_optimizer_the_engine_lacks_is_refused(
    op: str,
    mutate: Callable[[dict[str, Any]], None] | None,
    field: str,
    clean_redis: str,
    tmp_path: Path,
) -> None:
    """Every optimizer a request would step with is judged by the engine's capabilities."""
    lacking = Engines(
        TrainerCapabilities("plain", optimizers=frozenset()), SamplerCapabilities("x")
    )
    req = asyncio.run(_submit_request(op, _body(op, mutate)))
    with pytest.raises(UserInputError) as err:
        asyncio.run(_admit(clean_redis, tmp_path, req, lacking))
    assert str(err.value) == f"{field}: optimizer adamw does not run on the plain training engine"


def test_a_sampling_session_is_judged_by_the_scheduler(clean_redis: str, tmp_path: Path) -> None:
    """create_sampling_session: the gateway checks the session's id; the catalog the rest."""

    async def create(**fields: Any) -> None:
        body = {"session_id": SESSION, "sampling_session_seq_id": 1, **fields}
        request = sampling.create_sampling_session(
            OWNER, rq.CreateSamplingSessionRequest.model_validate(body)
        )
        ctx = await _context(clean_redis, tmp_path)
        try:
            await ctx.catalog.create_sampler(
                OWNER,
                request.session_id,
                request.sampling_session_seq_id,
                request.model_path if request.HasField("model_path") else None,
                request.base_model if request.HasField("base_model") else None,
            )
        finally:
            await ctx.store.close()

    for fields, message in (
        ({}, "model_path: give model_path or base_model"),
        ({"model_path": "x"}, "model_path: 'x' is not a tinker:// path"),
        ({"base_model": "tiny", "sampling_session_seq_id": -1}, "sampling_session_seq_id: must"),
    ):
        redis.Redis.from_url(clean_redis).flushdb()
        shutil.rmtree(tmp_path / "checkpoints", ignore_errors=True)
        with pytest.raises(UserInputError) as err:
            asyncio.run(create(**fields))
        assert str(err.value).startswith(message), str(err.value)


# What the gateway refuses itself: the address, and what the contract cannot carry (no field
# for it, or a value wider than its field). Nothing here is a rule the scheduler also judges.
GATEWAY = [
    ("optim_step", _set("model_id", "a/b"), "model_id: 'a/b' is not a valid id"),
    ("optim_step", _set("seq_id", 0), "seq_id: must be >= 1"),
    (
        "optim_step",
        _set("adam_params.type", "dimuon"),
        "adam_params.type: optimizer 'dimuon' is not supported",
    ),
    (
        "load_weights",
        _set("optimizer_config", {"type": "dimuon"}),
        "optimizer_config.type: optimizer 'dimuon' is not supported",
    ),
    ("save_weights_for_sampler", _set("kind", "other"), "kind: must be 'snapshot' or 'inflight'"),
    ("asample", _set("seq_id", DROP), "seq_id: field required"),
    ("asample", _set("prompt_alt_tokens_k", 2), "prompt_alt_tokens_k: not supported"),
    ("asample", _set("sampling_params.seed", 2**64), "sampling_params.seed: must fit in 64 bits"),
    (
        "asample",
        _set("prompt.chunks", [{"type": "dmel", "dmel": ""}]),
        "prompt.chunks[0]: chunk type 'dmel' is not supported for sampling",
    ),
]


@pytest.mark.parametrize("op, mutate, message", GATEWAY)
def test_the_gateway_refuses_only_the_address_and_what_the_contract_cannot_carry(
    op: str, mutate: Callable[[dict[str, Any]], None], message: str
) -> None:
    with pytest.raises(ApiError) as err:
        asyncio.run(_submit_request(op, _body(op, mutate)))
    assert err.value.status_code == 400 and err.value.detail.startswith(message), err.value.detail
