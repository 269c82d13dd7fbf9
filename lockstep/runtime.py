"""How Lockstep's long-lived processes run: the event loop and the heap.

- `run`: the scheduler's event loop is uvloop (libuv), as the gateway's is (uvicorn picks it
  with httptools): the stock selector loop cost about a tenth of the scheduler's CPU per
  request on the small requests the control plane is measured with.
- `settle_heap`: once a process has imported and built what it keeps for its life, those
  objects are moved out of the garbage collector's generations (`gc.freeze`). A full collection
  otherwise walks every module, route, model and tensor wrapper made at start-up: 12-30 ms
  here, paid by whichever request happened to trigger it (the p99s of small requests).
"""

from __future__ import annotations

import gc
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a new uvloop event loop."""
    return uvloop.run(main)


def settle_heap() -> None:
    """Collect once, then keep everything alive now out of later collections."""
    gc.collect()
    gc.freeze()
