"""refused: a request the gateway refused itself (body, decoding, shape, key) reaches the
scheduler as `Refused` only so that it still holds its seq_id (`Submissions._hold_seq`, the one
rule for every refusal); queued as "rejected", it never reaches an engine, and the planner
passes over it (it keeps the model's later requests from waiting behind a hole).
"""

from __future__ import annotations

from typing import ClassVar

from lockstep.scheduler.ops.base import Hold, Op, SubmitContext
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.vocab import OpKind


class Refused(Op):
    oneof = "refused"
    # Any op refused at submission, here or at the gateway, is queued as REJECTED.
    kinds: ClassVar[frozenset[str]] = frozenset({OpKind.REJECTED})
    holds_only = True

    def addressed(self, req: pb.SubmitRequest) -> tuple[str, int]:
        return req.refused.model_id, req.refused.seq_id

    async def admit(self, ctx: SubmitContext, req: pb.SubmitRequest) -> Hold:
        return Hold(req.refused.reason)
