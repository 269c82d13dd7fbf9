"""Adapter paging, the one copy every sampling engine uses.

A sampler knows every adapter published to it (by PEFT directory) but holds at most
`max_adapters` loaded at once, least recently used first out; a sample for an adapter that was
paged out loads it again, so paging never fails a sample. A batch is cut into chunks of at most
`max_adapters` distinct adapters so each chunk's adapters fit at once.

The pager only decides; the engine does the loading and unloading (in-process tensors for the
local sampler, HTTP calls for vLLM/SGLang) and tells the pager what happened.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from cachetools import LRUCache

from lockstep.engine.types import SampleRequest


class _Loaded(LRUCache[str, Path]):
    """Loaded adapter -> the directory it was loaded from; remembers what it paged out."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize)
        self.paged_out: list[str] = []

    def popitem(self) -> tuple[str, Path]:
        key, value = super().popitem()
        self.paged_out.append(key)
        return key, value


class AdapterPager:
    def __init__(self, max_adapters: int) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        self.max_adapters = max_adapters
        self._known: dict[str, Path] = {}  # every published adapter -> its PEFT directory
        self._loaded = _Loaded(max_adapters)

    # -- what the sampler knows ---------------------------------------------------------------

    def knows(self, adapter_id: str) -> bool:
        return adapter_id in self._known

    def directory(self, adapter_id: str) -> Path:
        return self._known[adapter_id]

    def remember(self, adapter_id: str, directory: Path) -> None:
        self._known[adapter_id] = Path(directory)

    def forget(self, adapter_id: str) -> bool:
        """Forget `adapter_id`; True when it was loaded (the engine unloads it)."""
        self._known.pop(adapter_id, None)
        return self._loaded.pop(adapter_id, None) is not None

    def forget_all(self) -> list[str]:
        """Forget everything; returns the adapters that were loaded."""
        self._known.clear()
        return self.unload_all()

    # -- what is loaded -----------------------------------------------------------------------

    def loaded(self) -> list[str]:
        """Loaded adapters (in no particular order)."""
        return list(self._loaded)

    def is_loaded(self, adapter_id: str, directory: Path | None = None) -> bool:
        """Loaded (from `directory`, when given); a loaded adapter counts as used."""
        loaded_from = self._loaded.get(adapter_id)
        return loaded_from is not None and (directory is None or loaded_from == Path(directory))

    def touch(self, adapter_ids: Iterable[str]) -> None:
        """Mark loaded adapters most recently used (a chunk's own must not be paged out)."""
        for adapter_id in adapter_ids:
            self._loaded.get(adapter_id)

    def admit(self, adapter_id: str, directory: Path, keep: Iterable[str] = ()) -> list[str]:
        """Record `adapter_id` as loaded from `directory`; returns the least recently used
        adapters to unload to make room. Those in `keep` (at most max_adapters - 1 others, as
        `chunks` guarantees) are used first so they stay."""
        self.touch(keep)
        self._loaded[adapter_id] = Path(directory)
        victims, self._loaded.paged_out = self._loaded.paged_out, []
        return victims

    def unloaded(self, adapter_id: str) -> None:
        """`adapter_id` is not loaded any more (a failed load; replaced under the same id)."""
        self._loaded.pop(adapter_id, None)

    def unload_all(self) -> list[str]:
        """Nothing is loaded any more (the server restarted or released its memory); returns
        what was."""
        loaded = self.loaded()
        self._loaded.clear()
        self._loaded.paged_out.clear()
        return loaded

    # -- batching -----------------------------------------------------------------------------

    def chunks(
        self, requests: Sequence[SampleRequest], indices: list[int], max_rows: int | None = None
    ) -> list[list[int]]:
        """Consecutive runs of `requests[indices]` with at most max_adapters distinct adapters
        (and at most `max_rows` samples; a single larger request still runs, alone)."""
        chunks: list[list[int]] = []
        current: list[int] = []
        adapters: set[str] = set()
        rows = 0
        for i in indices:
            req = requests[i]
            own = {req.adapter_id} if req.adapter_id is not None else set()
            grown = adapters | own
            too_many_rows = max_rows is not None and rows + req.num_samples > max_rows
            if current and (len(grown) > self.max_adapters or too_many_rows):
                chunks.append(current)
                current, rows, grown = [], 0, own
            current.append(i)
            adapters = grown
            rows += req.num_samples
        if current:
            chunks.append(current)
        return chunks
