"""Writes of several roles queued on one pipeline and sent together, one round trip: a cycle's
usage, audit entries and trace events; a sampling batch's answers with its usage and trace.

What a write means belongs to its role (`observers/accounting.py`, `observers/tracing.py`,
`sample_futures`); this module only queues the Redis commands. A best-effort write (a trace is
a diagnostic) that Redis refuses is logged, never raised; any other refused write raises once
the whole batch was sent, so one refusal never drops the writes beside it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from lockstep.scheduler.state import keys

log = logging.getLogger(__name__)
TRACE_FIELD = "e"  # a trace stream entry's one field: the event's JSON


class WriteBatch:
    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe  # a pipeline without MULTI: the commands go in one write
        self.replies: list[Any] = []  # each queued command's reply, once sent
        self._best_effort: list[tuple[int, int, str]] = []  # [start, end) of commands, what

    def next_index(self) -> int:
        """Where the next queued command's reply will be in `replies`."""
        return len(self.pipe)

    @contextmanager
    def best_effort(self, what: str) -> Iterator[None]:
        """The commands queued inside may fail without failing the batch (logged as `what`)."""
        start = self.next_index()
        yield
        self._best_effort.append((start, self.next_index(), what))

    # ------------------------------------------------------------------ the ledger
    def usage(self, owner: str, hour: int, amounts: Mapping[str, float], keep_s: int) -> None:
        """Add `amounts` to the owner's counters of `hour`; the hash expires `keep_s` later."""
        key = keys.usage(owner, hour)
        for name, amount in amounts.items():
            if amount:
                self.pipe.hincrbyfloat(key, name, amount)
        self.pipe.expire(key, keep_s)

    def audit(self, owner: str, event: str, details_json: str, keep_s: float) -> None:
        """Append an audit entry; entries older than `keep_s` go as the stream grows."""
        self.pipe.xadd(
            keys.audit(owner),
            {"event": event, "details": details_json},
            minid=str(int((time.time() - keep_s) * 1000)),
            approximate=True,
        )

    # ------------------------------------------------------------------ session traces
    def trace(
        self, per_session: Mapping[str, Sequence[str]], keep_events: int, retention_s: int
    ) -> None:
        """Append each session's trace events (JSON); events older than `retention_s` go as
        the stream grows, and past `keep_events` the oldest do (a long-lived session's trace
        stays bounded by age and by count); an idle session's goes whole."""
        oldest = str(int((time.time() - retention_s) * 1000))
        with self.best_effort("session trace"):
            for session_id, events in per_session.items():
                key = keys.session_trace(session_id)
                for event in events:
                    self.pipe.xadd(key, {TRACE_FIELD: event}, minid=oldest, approximate=True)
                self.pipe.xtrim(key, maxlen=keep_events, approximate=True)
                self.pipe.expire(key, retention_s)

    # ------------------------------------------------------------------ sending
    async def send(self) -> list[Any]:
        """Send what was queued (nothing: no round trip); the replies, also kept in `replies`."""
        if not self.next_index():
            return []
        self.replies = list(await self.pipe.execute(raise_on_error=False))
        refused: Exception | None = None
        for i, reply in enumerate(self.replies):
            if not isinstance(reply, Exception):
                continue
            what = next((w for start, end, w in self._best_effort if start <= i < end), None)
            if what is not None:
                log.warning("could not record the %s: %s", what, reply)
            elif refused is None:
                refused = reply
        if refused is not None:
            raise refused
        return self.replies
