"""Passes decoded once: a forward_backward is validated at submission in its decoded form
(`translate.pass_request`), and dispatch runs that same object instead of reading the payload
back from Redis and decoding it again.

Memory only, bounded by the values it holds: what does not fit, or what a restarted scheduler
never saw, dispatch reads from the job's payload (the durable copy) as before.
"""

from __future__ import annotations

from contextlib import suppress

from cachetools import LRUCache

from lockstep.engine.types import PassRequest

# About 8 bytes a value (int64 tokens, float32 loss inputs): 32M values ~ 256 MB.
DEFAULT_MAX_VALUES = 32_000_000


def _values(req: PassRequest) -> int:
    return max(
        1,
        sum(d.tokens.size + sum(a.size for a in d.loss_inputs.values()) for d in req.data),
    )


class DecodedPasses:
    def __init__(self, max_values: int = DEFAULT_MAX_VALUES) -> None:
        self._held: LRUCache[str, PassRequest] = LRUCache(max_values, getsizeof=_values)

    def keep(self, request_id: str, req: PassRequest) -> None:
        req.request_id = request_id
        with suppress(ValueError):  # larger than the whole bound: never held
            self._held[request_id] = req

    def take(self, request_id: str) -> PassRequest | None:
        """The decoded pass, once: a re-run (the cycle aborted) reads the payload again."""
        return self._held.pop(request_id, None)

    def peek(self, request_id: str) -> PassRequest | None:
        """The decoded pass, left held (the planner reads its datums' sizes)."""
        return self._held.get(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held
