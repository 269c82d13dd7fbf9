"""One row's loss (built-in or custom) and one request's PassResult from its rows.

Built-in losses give an elementwise loss (shape of target_tokens) whose sum is the datum's loss;
a custom loss gives a scalar per datum and scalar metrics `custom/<name>:sum|mean`, reduced over
the request's datums as the SDK reduces them client-side (`:mean` averages over datums).

A custom loss is differentiated at once, w.r.t. the row's logprobs only (`torch.autograd.grad`
on a detached copy): its graph is freed before the next row (what the pricing counted), a NaN or
inf gradient fails the row's request before anything of it reaches the model, and the pass's
backward carries `sum(logprobs * gradient)`, whose gradient is that same one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lockstep.custom_loss import program
from lockstep.engine.losses import CUSTOM
from lockstep.engine.types import Datum, PassRequest, PassResult
from lockstep.training.logprobs import Head, LinearHead, LogprobFn, gather_logprobs
from lockstep.training.losses import datum_logprobs, loss_from_logprobs


@dataclass
class RowLoss:
    logprobs: torch.Tensor  # shape of target_tokens
    loss: torch.Tensor  # elementwise (built-in) or scalar (custom); its sum is the row's loss
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # custom losses only
    # What the row adds to the pass's backward (None: nothing, e.g. a loss that ignores it).
    backward: torch.Tensor | None = None

    def detached(self) -> RowLoss:
        return RowLoss(
            self.logprobs.detach(),
            self.loss.detach(),
            {k: v.detach() for k, v in self.metrics.items()},
        )


def row_loss(
    hidden: torch.Tensor,
    datum: Datum,
    req: PassRequest,
    config: dict[str, float],
    head: Head | LinearHead,
    chunk: int,
    logprob_fn: LogprobFn = gather_logprobs,
) -> RowLoss:
    """The loss of one datum from its final hidden states [T, H] (with what it adds to the
    backward when autograd records).

    Raises:
        UserInputError: the row's request fails alone (its custom loss fails, or its loss or
            gradient is not finite).
    """
    logp = datum_logprobs(hidden, datum, head, chunk, logprob_fn)
    if req.loss_fn != CUSTOM:
        logp, loss = loss_from_logprobs(logp, datum, req.loss_fn, config)
        return RowLoss(logp, loss, backward=loss.sum() if loss.requires_grad else None)
    assert req.custom_loss is not None, "validated: a custom request carries its loss"
    logp = logp.reshape(np.asarray(datum.loss_inputs["target_tokens"]).shape)
    if not logp.requires_grad:  # a forward
        value, metrics = program.evaluate(req.custom_loss, logp, datum)
        return RowLoss(logp, value, metrics)
    leaf = logp.detach().requires_grad_()
    value, metrics = program.evaluate(req.custom_loss, leaf, datum)
    metrics = {k: v.detach() for k, v in metrics.items()}
    if not value.requires_grad:  # the loss does not read the logprobs
        return RowLoss(logp, value.detach(), metrics)
    (grad,) = torch.autograd.grad(value, leaf, allow_unused=True)
    if grad is None:
        return RowLoss(logp, value.detach(), metrics)
    program.check_finite(req.custom_loss, "gradient", grad)
    return RowLoss(logp, value.detach(), metrics, (logp * grad).sum())


def pass_result(req: PassRequest, rows: list[RowLoss]) -> PassResult:
    total = torch.stack([r.loss.sum() for r in rows]).sum()
    metrics = {"loss:sum": float(total)}
    for key in rows[0].metrics if rows else ():
        values = torch.stack([r.metrics[key].float() for r in rows])
        metrics[key] = float(values.mean() if key.endswith(":mean") else values.sum())
    if req.loss_fn == CUSTOM:  # one number per datum: no per-token loss to return
        outputs = [{"logprobs": _to_numpy(r.logprobs)} for r in rows]
    else:
        outputs = [
            {"logprobs": _to_numpy(r.logprobs), "elementwise_loss": _to_numpy(r.loss)} for r in rows
        ]
    return PassResult(request_id=req.request_id, outputs=outputs, metrics=metrics)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()
