"""What `sgd_step` adds to proto/lockstep/v1/scheduler.proto: its request and its result, and
their places in `SubmitRequest.op` and `JobResult.result` (then `proto/generate.sh`)."""

from __future__ import annotations

MESSAGES = """// sgd_step: a plain SGD step of the model's accumulated gradients.
message SgdStep {
  string model_id = 1;
  int64 seq_id = 2;
  double learning_rate = 3;
}
message SgdStepResult { double grad_norm = 1; }

"""
# (where, what): each addition goes right before the line `where` starts.
PROTO = (
    ("message SubmitRequest {", MESSAGES),
    ("  }\n}\n\nmessage SubmitReply {", "    SgdStep sgd_step = 17;\n"),
    ("  }\n}\n\nmessage JobError {", "    SgdStepResult sgd_step = 9;\n"),
)


def added(proto: str) -> str:
    """The project's scheduler.proto with the op's additions (each place found once)."""
    for where, what in PROTO:
        assert proto.count(where) == 1, f"scheduler.proto changed: {where!r} not found once"
        proto = proto.replace(where, what + where)
    return proto
