"""Finished samples' answers that a session poll brought along (`FutureCompletion.answer`),
kept for the SDK's `retrieve_future` that follows each completion: that call is then answered
here, without a scheduler call. Each answer is served once; a miss (another gateway replica
polled, the answer expired or did not fit) asks the scheduler, which keeps every result."""

from __future__ import annotations

from collections.abc import Iterable

from cachetools import TTLCache

from lockstep.v1 import scheduler_pb2 as pb

# Bytes of answers kept (oldest dropped first) and how long one waits for its retrieve_future.
MAX_BYTES = 64 << 20
TTL_S = 120.0


class Answers:
    def __init__(self, max_bytes: int = MAX_BYTES, ttl_s: float = TTL_S) -> None:
        self._kept: TTLCache[tuple[str, str], pb.FutureReply] = TTLCache(
            maxsize=max_bytes, ttl=ttl_s, getsizeof=_size
        )

    def keep(self, owner: str, completions: Iterable[pb.FutureCompletion]) -> None:
        for c in completions:
            if c.HasField("answer") and _size(c.answer) <= self._kept.maxsize:
                self._kept[(owner, c.request_id)] = c.answer

    def take(self, owner: str, request_id: str) -> pb.FutureReply | None:
        return self._kept.pop((owner, request_id), None)


def _size(answer: pb.FutureReply) -> int:
    size: int = answer.ByteSize()
    return size + 64  # an empty answer still takes room
