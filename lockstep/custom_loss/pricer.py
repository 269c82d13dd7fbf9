"""Pricing in a process of its own, so a cold or costly pricing never stalls the scheduler.

Pricing runs torch on meta tensors: the first one in a process pays for torch's op
decompositions (seconds), and a 510-node graph on new shapes takes hundreds of milliseconds of
pure Python. In the scheduler's own interpreter that held the GIL away from its event loop, and
so from every other tenant's submissions and cycles. `Pricer` hands each check to one worker
process (started on first use, kept for its caches: a bucket priced once stays priced) and
awaits the answer. Only shapes cross to it, never a datum's values.

A worker that dies while pricing (a graph that exhausts its memory, say) is replaced and the
check runs once more; a loss that ends two workers in a row is refused by name.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from lockstep.custom_loss import graph
from lockstep.custom_loss.bound import CostBound
from lockstep.engine.types import CustomLoss, Datum
from lockstep.errors import UserInputError

T = TypeVar("T")


def _created(loss: CustomLoss, bound: CostBound, max_tokens: int) -> None:
    from lockstep.custom_loss import pricing  # torch: imported in the worker only

    pricing.check_created(loss, bound, max_tokens)


def _shapes(loss: CustomLoss, shapes: Sequence[tuple[graph.Shapes, int]], bound: CostBound) -> None:
    from lockstep.custom_loss import pricing

    pricing.check_shapes(loss, shapes, bound)


class Pricer:
    """One pricing worker process, shared by every check of the scheduler."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"))
            return self._pool

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    async def _run(self, loss: CustomLoss, fn: Callable[..., T], *args: Any) -> T:
        for attempt in range(2):
            pool = self._executor()
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
            except BrokenProcessPool:
                self._replace(pool)
                if attempt:
                    raise UserInputError(
                        "graph",
                        f"pricing custom loss {loss.name!r} ended the pricing process twice; "
                        "refused",
                    ) from None
        raise AssertionError("unreachable")

    async def check_created(self, loss: CustomLoss, bound: CostBound, max_tokens: int) -> None:
        """`pricing.check_created` in the worker: UserInputError naming the node."""
        await self._run(loss, _created, loss, bound, max_tokens)

    async def check_data(self, loss: CustomLoss, data: Sequence[Datum], bound: CostBound) -> None:
        """Each datum's price within the bound (`pricing.check_shapes` on its shapes):
        UserInputError naming the datum and the node."""
        shapes = [(graph.datum_shapes(loss, d), len(d.tokens)) for d in data]
        await self._run(loss, _shapes, loss, shapes, bound)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
