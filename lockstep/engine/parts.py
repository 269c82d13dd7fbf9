"""A request run in parts: cutting it into part requests and joining their results.

The scheduler runs a forward / forward_backward larger than its tenant's share of a shared
cycle as parts of whole datums in consecutive cycles (`TrainingEngine.run_passes`, "Parts").
Every number of a request's result is a per-datum value or a reduction over its datums, so the
parts' results joined here are the whole request's: outputs in datum order, `:sum` metrics
added, `:mean` metrics weighted by each part's datums (a mean over all datums).
"""

from __future__ import annotations

import dataclasses

from lockstep.engine.types import PassPart, PassRequest, PassResult


def part_request(req: PassRequest, start: int, stop: int) -> PassRequest:
    """Datums [start, stop) of `req` as one part (WHOLE when that is all of them)."""
    count = len(req.data)
    if start == 0 and stop == count:
        return req
    first, last = start == 0, stop == count
    part = PassPart.FIRST if first else PassPart.LAST if last else PassPart.MIDDLE
    return dataclasses.replace(req, data=req.data[start:stop], part=part)


def join_metrics(pieces: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of datums reported in pieces ((metrics, datums) each) as one reduction over
    all of them: `:sum` added, `:mean` weighted by each piece's datums. A metric a piece lacks
    is joined over the pieces that have it (the history of a run whose losses changed).

    Raises:
        ValueError: a metric whose reduction is not `sum` or `mean` (not one an engine makes;
            refused rather than reduced wrongly).
    """
    sums: dict[str, float] = {}
    weights: dict[str, int] = {}
    for metrics, datums in pieces:
        for key, value in metrics.items():
            reduction = key.rpartition(":")[2]
            if reduction == "sum":
                sums[key] = sums.get(key, 0.0) + value
            elif reduction == "mean":
                sums[key] = sums.get(key, 0.0) + value * datums
                weights[key] = weights.get(key, 0) + datums
            else:
                raise ValueError(f"metric {key!r}: no rule joins its reduction over parts")
    return {k: float(v / max(weights[k], 1)) if k in weights else float(v) for k, v in sums.items()}


def join_results(parts: list[PassResult]) -> PassResult:
    """The whole request's result from its parts' results, in part order.

    Raises:
        ValueError: a metric whose reduction is not `sum` or `mean` (not one an engine makes;
            refused rather than reduced wrongly), or parts that disagree on their metrics.
    """
    if len(parts) == 1:
        return parts[0]
    if any(list(p.metrics) != list(parts[0].metrics) for p in parts):
        raise ValueError("the parts of one request returned different metrics")
    metrics = join_metrics([(p.metrics, len(p.outputs)) for p in parts])
    outputs = [out for p in parts for out in p.outputs]
    return PassResult(request_id=parts[0].request_id, outputs=outputs, metrics=metrics)
