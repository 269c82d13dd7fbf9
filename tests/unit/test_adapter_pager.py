"""The adapter pager every sampler shares (lockstep/rollout/pager.py): what is paged out, when,
and how a batch is cut so each chunk's adapters fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.engine.types import SampleParams, SampleRequest
from lockstep.rollout.pager import AdapterPager


def req(adapter: str | None, rows: int = 1) -> SampleRequest:
    return SampleRequest(f"r-{adapter}", adapter, [1], rows, SampleParams())


def test_least_recently_used_is_paged_out_and_kept_ones_stay() -> None:
    pager = AdapterPager(2)
    assert pager.admit("a", Path("/a")) == []
    assert pager.admit("b", Path("/b")) == []
    pager.touch(["a"])  # b is now the least recently used
    assert pager.admit("c", Path("/c")) == ["b"]
    assert sorted(pager.loaded()) == ["a", "c"]
    assert pager.admit("b", Path("/b"), keep=["a"]) == ["c"]  # a is kept although older
    assert sorted(pager.loaded()) == ["a", "b"]


def test_loaded_from_which_directory() -> None:
    pager = AdapterPager(1)
    pager.remember("a", Path("/a/v1"))
    pager.admit("a", Path("/a/v1"))
    assert pager.is_loaded("a") and pager.is_loaded("a", Path("/a/v1"))
    assert not pager.is_loaded("a", Path("/a/v2"))  # republished: must be loaded again
    pager.unloaded("a")  # a failed load
    assert not pager.is_loaded("a") and pager.knows("a")  # still known: loaded on demand
    assert pager.directory("a") == Path("/a/v1")


def test_forget_says_whether_to_unload() -> None:
    pager = AdapterPager(2)
    for name in ("a", "b"):
        pager.remember(name, Path(f"/{name}"))
    pager.admit("a", Path("/a"))
    assert pager.forget("a") is True
    assert pager.forget("b") is False  # known, never loaded
    assert not pager.knows("a") and not pager.knows("b")
    pager.remember("c", Path("/c"))
    pager.admit("c", Path("/c"))
    assert pager.unload_all() == ["c"] and pager.knows("c")
    assert pager.admit("d", Path("/d")) == []  # nothing left to page out
    assert pager.forget_all() == ["d"] and not pager.knows("c")


def test_chunks_hold_at_most_max_adapters_and_rows() -> None:
    pager = AdapterPager(2)
    requests = [req("a"), req("b"), req(None), req("a"), req("c"), req("c", rows=3), req("d")]
    chunks = pager.chunks(requests, list(range(len(requests))))
    assert chunks == [[0, 1, 2, 3], [4, 5, 6]]
    assert pager.chunks(requests, list(range(len(requests))), max_rows=3) == [
        [0, 1, 2],
        [3, 4],
        [5],  # one request larger than max_rows still runs, alone
        [6],
    ]
    for chunk in chunks:
        assert len({requests[i].adapter_id for i in chunk} - {None}) <= 2


def test_max_adapters_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_adapters"):
        AdapterPager(0)
