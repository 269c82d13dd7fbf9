"""Find the request that kills an engine, with a bounded number of restarts.

The dispatcher keeps one hunt for the training engine (fused passes), the sampling lane one for
the sampling engine (sample batches). A fused pass that kills the engine (signal, OOM kill)
leaves nothing recorded: the cycle runs again on a fresh engine. A request that kills it
deterministically would do so forever, and every tenant would wait behind it. So the dispatcher
(and the lane) keep score here:

- first death: the same work runs again (most deaths are not the requests' fault);
- second death of a call holding some of the same requests: those are the suspects; from then on
  the cycle runs the suspects in two halves, one call each, then everyone else fused; a half that
  dies becomes the suspects (a half that finishes is cleared; the others wait until the suspects
  are cleared, so a second poison among them starts an incident of its own);
- a call of ONE suspect that dies: that request is refused (category user) and everyone else runs.

At most 2 + ceil(log2(requests)) restarts per incident. Requests are identified by request id,
which stays the same while a request waits in its queue across aborted cycles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
MAX_REFUSED = 1024


@dataclass
class PoisonHunt:
    request: str = "forward_backward"  # what the refusal calls the request...
    engine: str = "training engine"  # ...and the engine it killed
    hint: str = "a smaller batch or shorter rows may fit"
    died_once: frozenset[str] = frozenset()
    suspects: frozenset[str] = frozenset()
    deaths: dict[str, int] = field(default_factory=dict)  # per request id, while suspected
    refused: dict[str, str] = field(default_factory=dict)  # request id -> why

    def verdict(self, request_id: str) -> str | None:
        """Why this request is refused (it killed the engine on its own), or None. Kept, not
        consumed: the cycle that refuses it may itself be abandoned and planned again."""
        return self.refused.get(request_id)

    def calls(self, ids: list[str], items: list[T]) -> list[list[T]]:
        """How to cut one fused pass (`items`, identified by `ids`) into engine calls."""
        suspect = [x for i, x in zip(ids, items, strict=True) if i in self.suspects]
        if not suspect:
            return [items] if items else []
        others = [x for i, x in zip(ids, items, strict=True) if i not in self.suspects]
        half = (len(suspect) + 1) // 2
        return [c for c in (suspect[:half], suspect[half:], others) if c]

    def survived(self, ids: list[str]) -> None:
        done = frozenset(ids)
        self.died_once -= done
        self.suspects -= done
        for i in done:
            self.deaths.pop(i, None)

    def died(self, ids: list[str], reason: str) -> None:
        """The engine died in a call of these requests."""
        call = frozenset(ids)
        for i in call:
            self.deaths[i] = self.deaths.get(i, 0) + 1
        if call & self.suspects:
            narrowed = call & self.suspects
        elif call & self.died_once:
            narrowed = call & self.died_once
        else:  # a first death: run the same work again
            self.died_once = call
            return
        self.died_once = frozenset()
        if len(narrowed) == 1:
            (culprit,) = narrowed
            self.refused[culprit] = (
                f"this {self.request} crashed the {self.engine} {self.deaths.pop(culprit)} "
                f"times ({reason}); it is refused ({self.hint})"
            )
            self.suspects = frozenset()
            while len(self.refused) > MAX_REFUSED:  # oldest first; long answered by then
                del self.refused[next(iter(self.refused))]
        else:
            self.suspects = narrowed
