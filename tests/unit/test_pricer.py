"""The pricing worker: pricing runs in a process of its own (the scheduler's interpreter never
holds the GIL for it), keeps that process (and its caches) between checks, gives the same
answers as pricing in place, and replaces a worker that dies; a loss that ends two workers in a
row is refused by name."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import numpy as np
import pytest

from lockstep.custom_loss import graph
from lockstep.custom_loss.bound import CostBound
from lockstep.custom_loss.pricer import Pricer
from lockstep.engine.types import CustomLoss, CustomLossNode, Datum, MemoryBudget
from lockstep.errors import UserInputError

BOUND = CostBound.of(0, MemoryBudget(8 << 30, 4096, "test"))


def _loss(nodes: list[CustomLossNode]) -> CustomLoss:
    return graph.build_loss("s:loss:0", "probe", [("logprobs", 1)], nodes)


def _sum_loss() -> CustomLoss:
    return _loss(
        [
            CustomLossNode("placeholder", "logprobs", "logprobs"),
            CustomLossNode("call_method", "total", "sum", ({"ref": "logprobs"},)),
            CustomLossNode("call_function", "loss", "operator.neg", ({"ref": "total"},)),
            CustomLossNode(
                "output", "output", "output", ({"tuple": [{"ref": "loss"}, {"dict": {}}]},)
            ),
        ]
    )


def _outer_loss() -> CustomLoss:
    """An outer product of logprobs with itself: T x T elements, over the memory bound for a
    long datum."""
    return _loss(
        [
            CustomLossNode("placeholder", "logprobs", "logprobs"),
            CustomLossNode(
                "call_function", "outer", "torch.outer", ({"ref": "logprobs"}, {"ref": "logprobs"})
            ),
            CustomLossNode("call_method", "loss", "sum", ({"ref": "outer"},)),
            CustomLossNode(
                "output", "output", "output", ({"tuple": [{"ref": "loss"}, {"dict": {}}]},)
            ),
        ]
    )


def _datum(t: int) -> Datum:
    return Datum(np.zeros(t, np.int64), {"target_tokens": np.zeros(t, np.int64)})


@pytest.fixture(scope="module")
def shared() -> Iterator[Pricer]:
    p = Pricer()  # one worker (torch imported once) for the tests that do not kill it
    yield p
    p.close()


def test_pricing_runs_in_one_worker_process_kept_between_checks(shared: Pricer) -> None:
    async def run() -> tuple[int, int]:
        await shared.check_created(_sum_loss(), BOUND, 4096)
        await shared.check_data(_sum_loss(), [_datum(8), _datum(300)], BOUND)
        return await shared._run(_sum_loss(), os.getpid), await shared._run(_sum_loss(), os.getpid)

    first, second = asyncio.run(run())
    assert first == second != os.getpid()


def test_the_worker_refuses_what_pricing_in_place_refuses(shared: Pricer) -> None:
    tight = CostBound(flops_per_token=1 << 30, memory_bytes=1 << 20)

    async def run() -> None:
        await shared.check_data(_outer_loss(), [_datum(64)], tight)  # 16 KiB: fits
        with pytest.raises(UserInputError) as err:
            await shared.check_data(_outer_loss(), [_datum(64), _datum(4096)], tight)
        assert err.value.field == "data[1]" and "graph.nodes[1]" in str(err.value)

    asyncio.run(run())


def test_a_dead_worker_is_replaced_and_a_loss_that_kills_two_is_refused() -> None:
    async def run() -> None:
        p = Pricer()
        try:
            with pytest.raises(UserInputError) as err:
                await p._run(_sum_loss(), os._exit, 1)  # the worker dies, then its successor
            assert err.value.field == "graph" and "ended the pricing process twice" in str(
                err.value
            )
            await p.check_created(_sum_loss(), BOUND, 4096)  # a fresh worker prices again
        finally:
            p.close()

    asyncio.run(run())


def test_only_shapes_cross_to_the_worker() -> None:
    datum = Datum(
        np.zeros(5, np.int64),
        {"target_tokens": np.zeros(5, np.int64), "adv": np.ones(5, np.float32)},
    )
    loss = graph.build_loss(
        "s:loss:1",
        "two",
        [("logprobs", 1), ("adv", 1)],
        [
            CustomLossNode("placeholder", "logprobs", "logprobs"),
            CustomLossNode("placeholder", "adv", "adv"),
            CustomLossNode(
                "call_function", "m", "torch.mul", ({"ref": "logprobs"}, {"ref": "adv"})
            ),
            CustomLossNode("call_method", "loss", "sum", ({"ref": "m"},)),
            CustomLossNode(
                "output", "output", "output", ({"tuple": [{"ref": "loss"}, {"dict": {}}]},)
            ),
        ],
    )
    assert graph.datum_shapes(loss, datum) == (((5,), "float32"), ((5,), "float32"))
