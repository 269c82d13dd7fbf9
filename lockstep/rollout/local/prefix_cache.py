"""A bounded per-session prefix KV cache for the local sampler.

Each sampling session (`SampleRequest.cache_namespace`) keeps the prompt KV of its recent requests,
keyed by the prompt's content (token ids; an image's placeholders by the image's digest),
per adapter (an adapter's LoRA changes keys and values). A later prompt of the same session and
adapter whose first m tokens match a kept prompt reuses those m positions' keys and values and
prefills only the rest. Entries are exact: positions are absolute (RoPE applied at 0..m-1), and
causal attention makes a prefix's KV independent of what follows it.

Bounds: at most `max_sessions` sessions and `max_bytes` of cached keys and values in all (least
recently used sessions dropped first), and at most `max_tokens_per_session` cached prompt tokens
per session (its oldest entries dropped first). A new namespace starts empty; sessions never share
entries.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, heads, n, head_dim]


@dataclass
class _Entry:
    adapter_id: str | None
    tokens: tuple[object, ...]  # token ids; an image's placeholders as (its digest, k)
    kv: KV

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.kv)


@dataclass
class Hit:
    """`length` leading prompt tokens are cached in `kv` (possibly longer: slice it)."""

    length: int
    kv: KV


def _common_prefix(a: tuple[object, ...], b: Sequence[object]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    def __init__(
        self,
        max_sessions: int = 64,
        max_tokens_per_session: int = 8192,
        max_bytes: int = 1 << 30,
    ) -> None:
        self.max_sessions = max_sessions
        self.max_tokens_per_session = max_tokens_per_session
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, list[_Entry]] = OrderedDict()
        self._bytes = 0

    def lookup(
        self, namespace: str, adapter_id: str | None, prompt: Sequence[object]
    ) -> Hit | None:
        """The longest cached prefix of `prompt` in this session, leaving >= 1 token to feed
        (the last position's logits are needed for the first new token)."""
        entries = self._sessions.get(namespace)
        if not entries:
            return None
        self._sessions.move_to_end(namespace)
        best: _Entry | None = None
        length = 0
        for entry in entries:
            if entry.adapter_id != adapter_id:
                continue
            m = min(_common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if m > length:
                best, length = entry, m
        return Hit(length, best.kv) if best is not None else None

    def store(
        self, namespace: str, adapter_id: str | None, prompt: Sequence[object], kv: KV
    ) -> None:
        """Keep `prompt`'s KV for the session; a kept prompt it extends is replaced."""
        if len(prompt) > self.max_tokens_per_session:
            return
        tokens = tuple(prompt)
        for e in self._sessions.get(namespace, []):
            if e.adapter_id == adapter_id and e.tokens[: len(tokens)] == tokens:
                return  # already covered by a longer kept prompt
        entry = _Entry(adapter_id, tokens, kv)
        if entry.nbytes > self.max_bytes:
            return
        entries = self._sessions.pop(namespace, [])
        kept = []
        for e in entries:
            if e.adapter_id == adapter_id and tokens[: len(e.tokens)] == e.tokens:
                self._bytes -= e.nbytes  # the new prompt extends it
            else:
                kept.append(e)
        kept.append(entry)
        self._bytes += entry.nbytes
        while sum(len(e.tokens) for e in kept) > self.max_tokens_per_session:
            self._bytes -= kept.pop(0).nbytes
        self._sessions[namespace] = kept
        while len(self._sessions) > self.max_sessions or self._bytes > self.max_bytes:
            _, dropped = self._sessions.popitem(last=False)
            self._bytes -= sum(e.nbytes for e in dropped)

    def forget_adapter(self, adapter_id: str) -> None:
        """The adapter's weights changed or left: its entries are no longer valid."""
        for namespace, entries in list(self._sessions.items()):
            kept = [e for e in entries if e.adapter_id != adapter_id]
            self._bytes -= sum(e.nbytes for e in entries if e.adapter_id == adapter_id)
            if kept:
                self._sessions[namespace] = kept
            else:
                del self._sessions[namespace]

    def cached_tokens(self) -> int:
        return sum(len(e.tokens) for entries in self._sessions.values() for e in entries)

    def cached_bytes(self) -> int:
        return self._bytes
