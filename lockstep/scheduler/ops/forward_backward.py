"""forward and forward_backward: every tenant's passes run as ONE fused pass per cycle.

Validated at submission in their decoded form (token ids, loss inputs, sizes, the memory
budget, a named custom loss and its price on each datum: `state/custom_losses.py`); that decoded
request is kept (`scheduler/admission/decoded.py`) and the dispatcher hands it to the fused pass
as it is. Only a forward_backward changes the model (gradients), so only it is replayed after a
restore and counts as trained tokens.
"""

from __future__ import annotations

import math
from typing import ClassVar

from lockstep.engine import losses, memory
from lockstep.engine.images import ImageReader
from lockstep.engine.types import PassRequest, PassResult
from lockstep.errors import UserInputError
from lockstep.scheduler import translate
from lockstep.scheduler.ops.base import Claim, PassOp, Phase, SubmitContext, check_seq
from lockstep.scheduler.state import custom_losses
from lockstep.scheduler.state.outcome import Outcome
from lockstep.scheduler.state.records import QueuedOp
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind
from lockstep.wire.v1 import tinker_pb2 as wire


class ForwardBackward(PassOp):
    oneof = "forward_backward"
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.FORWARD, OpKind.FORWARD_BACKWARD})

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.forward_backward.model_id, req.forward_backward.seq_id

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Claim:
        fb = req.forward_backward
        model = await ctx.owned_model(req.owner, fb.model_id)
        check_seq(fb.seq_id)
        if not fb.data:
            raise UserInputError("data", "no datums given")
        check_data_length(ctx, fb)
        ctx.engines.trainer.check_loss(fb.loss_fn)  # e.g. custom losses where none run
        for i, datum in enumerate(fb.data):
            translate.inline_assets(datum.model_input, f"data[{i}].model_input", ctx.images)
        pass_req = translate.pass_request("", fb, ctx.images)  # its request id once claimed
        check_sizes(ctx, pass_req)
        await custom_losses.attach(ctx.store, pass_req, model)  # one of its session's
        losses.validate_pass_request(pass_req, ctx.card.vocab_size, ctx.card.max_context_length)
        await ctx.custom_losses.check_data(pass_req)  # its inputs' ranks, its price per datum
        kind = OpKind.FORWARD if fb.forward_only else OpKind.FORWARD_BACKWARD
        tokens = translate.pass_tokens(pass_req)
        return Claim(
            fb.model_id, fb.seq_id, kind, tokens, decoded=pass_req, live_session=model.session_id
        )

    def phase(self, current: Phase) -> Phase | None:
        return Phase.PASS if current <= Phase.PASS else None

    def backward(self, kind: str) -> bool:
        return kind == OpKind.FORWARD_BACKWARD

    async def decode(
        self, store: Store, images: ImageReader, request_id: str, req: pb.SubmitRequest
    ) -> PassRequest:
        pass_req = translate.pass_request(request_id, req.forward_backward, images)
        await custom_losses.attach(store, pass_req)
        return pass_req

    def outcome(self, op: QueuedOp, result: PassResult, cycle: int) -> Outcome:
        output = translate.pass_output(result, cycle)
        return Outcome(
            pb.JobResult(forward_backward=output),
            replayed=self.backward(op.kind),
            metrics=dict(result.metrics),
            datums=len(result.outputs),
        )


def check_data_length(ctx: SubmitContext, fb: wire.ForwardBackwardRequest) -> None:
    """Datums per request: checked before any datum is decoded."""
    most = ctx.limits.max_datums_per_request
    if len(fb.data) > most:
        raise UserInputError(
            "data",
            f"has {len(fb.data)} datums; this server accepts at "
            f"most {most} per request (max_datums_per_request)",
        )


def check_sizes(ctx: SubmitContext, req: PassRequest) -> None:
    """The size limits of each decoded datum: model-input tokens (image placeholders included)
    and the admission rule: a datum whose pass the training engine's memory cannot hold, an
    image the vision tower's pass cannot."""
    per_datum, fits = ctx.limits.max_tokens_per_datum, ctx.memory.max_row_tokens
    patches = ctx.memory.max_image_patches
    for i, datum in enumerate(req.data):
        n = len(datum.tokens)
        if per_datum and n > per_datum:
            raise UserInputError(
                f"data[{i}].model_input",
                f"has {n} tokens; this server accepts at most {per_datum} (max_tokens_per_datum)",
            )
        if fits and fits < n <= ctx.card.max_context_length:  # longer: the context rule
            raise UserInputError(
                f"data[{i}].model_input",
                f"has {n} tokens; a training pass fits rows of at most {fits} tokens in "
                f"the training engine's memory budget of {memory.describe(ctx.memory)}",
            )
        for image in datum.images:
            size = math.prod(image.grid)
            if patches and size > patches:
                raise UserInputError(
                    f"data[{i}].model_input",
                    f"has an image of {size} patches at position {image.position}; the vision "
                    f"tower's pass fits images of at most {patches} patches in the training "
                    f"engine's memory budget of {memory.describe(ctx.memory)}",
                )
