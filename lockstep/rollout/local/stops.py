"""When a generated sequence stops: stop tokens, EOS, stop strings, max_tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from lockstep.engine.types import SampleParams, StopReason

Decode = Callable[[Sequence[int]], str]


class StopChecker:
    """Decides, after each appended token, whether one sequence is finished and why.

    * A stop token (an explicit `stop_tokens` id, or an EOS id while `stop_at_eos`) stops the
      sequence with that token kept as its last token.
    * A stop string stops it as soon as the decoded completion contains the string; the tokens are
      kept up to and including the one that completed the match.
    * Otherwise the sequence ends with "length" at `max_tokens`.

    Stop strings are matched on a decoded tail window, not the whole completion, so the check is
    O(1) per token. Every token decodes to at least one byte and a character is at most 4 bytes, so
    a match of L characters that a new token completes lies within the last 4·L + 2 tokens. A
    match is found at the first step where it exists, hence the window never misses or delays it.
    """

    def __init__(self, params: SampleParams, eos_ids: Iterable[int], decode: Decode) -> None:
        stop_ids = set(params.stop_tokens)
        if params.stop_at_eos:
            stop_ids.update(eos_ids)
        self._stop_ids = frozenset(stop_ids)
        self._strings = tuple(s for s in params.stop_strings if s)
        self._window = 4 * max((len(s) for s in self._strings), default=0) + 2
        self._decode = decode
        self._max_tokens = params.max_tokens

    def check(self, completion: Sequence[int]) -> StopReason | None:
        """`completion` = every token generated so far (the newest last); None = keep going."""
        if completion:
            if completion[-1] in self._stop_ids:
                return "stop"
            if self._strings:
                text = self._decode(completion[-self._window :])
                if any(s in text for s in self._strings):
                    return "stop"
        if len(completion) >= self._max_tokens:
            return "length"
        return None
