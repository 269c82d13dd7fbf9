"""Requests decoded once: a forward_backward or a sample is validated at submission in its
decoded form (`translate.pass_request`, `translate.sample_request`), and dispatch or the sampling
lane runs that same object instead of reading the payload back from Redis and decoding it again.

Memory only, bounded by the values it holds: what does not fit, or what a restarted scheduler
never saw, is decoded from the job's payload (the durable copy) as before.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import suppress
from typing import Generic, Protocol, TypeVar

from cachetools import LRUCache

from lockstep.engine.types import PassRequest, SampleRequest

# About 8 bytes a value (int64 tokens, float32 loss inputs): 32M values ~ 256 MB.
DEFAULT_MAX_VALUES = 32_000_000


class _Request(Protocol):
    request_id: str


R = TypeVar("R", bound=_Request)


class Decoded(Generic[R]):
    """Decoded requests by request id, each handed out once; `size` counts a request's values."""

    def __init__(self, size: Callable[[R], int], max_values: int = DEFAULT_MAX_VALUES) -> None:
        self._held: LRUCache[str, R] = LRUCache(max_values, getsizeof=lambda r: max(1, size(r)))

    def keep(self, request_id: str, req: R) -> None:
        req.request_id = request_id
        with suppress(ValueError):  # larger than the whole bound: never held
            self._held[request_id] = req

    def take(self, request_id: str) -> R | None:
        """The decoded request, once: a re-run (the cycle aborted) decodes the payload again."""
        return self._held.pop(request_id, None)

    def peek(self, request_id: str) -> R | None:
        """The decoded request, left held (the planner reads a pass's datums' sizes)."""
        return self._held.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held


def _pass_values(req: PassRequest) -> int:
    return sum(d.tokens.size + sum(a.size for a in d.loss_inputs.values()) for d in req.data)


def _sample_values(req: SampleRequest) -> int:
    return len(req.prompt) + sum(len(i.data) // 8 for i in req.images)


class DecodedPasses(Decoded[PassRequest]):
    def __init__(self, max_values: int = DEFAULT_MAX_VALUES) -> None:
        super().__init__(_pass_values, max_values)


class DecodedSamples(Decoded[SampleRequest]):
    def __init__(self, max_values: int = DEFAULT_MAX_VALUES // 4) -> None:
        super().__init__(_sample_values, max_values)
