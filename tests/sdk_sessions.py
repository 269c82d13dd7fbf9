"""Close the `tinker.ServiceClient` sessions tests open, in one place (tests/conftest.py hooks).

An SDK session heartbeats every 10 s until it is closed; one left open outlives its test and,
once its server has stopped, logs "Session heartbeat failed for N s" for the rest of the run.
Every ServiceClient created while a test or a fixture is being set up is recorded here, and
closed (`close("success")`, which finishes the session on the server and stops the heartbeat)
when that test ends or that fixture is torn down.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

CLOSE_WAIT_S = 10.0  # a server already stopped answers nothing; its client's close gives up later

_lock = threading.Lock()
_collectors: list[list[Any]] = []  # innermost last: a fixture set up inside another's setup


def _record(client: Any) -> None:
    with _lock:
        if _collectors:
            _collectors[-1].append(client)


@contextlib.contextmanager
def collect() -> Iterator[list[Any]]:
    """The ServiceClients created (by any thread) until the block ends."""
    opened: list[Any] = []
    with _lock:
        _collectors.append(opened)
    try:
        yield opened
    finally:
        with _lock:  # by identity: two collectors holding equal lists are still two
            _collectors[:] = [c for c in _collectors if c is not opened]


def close(clients: list[Any]) -> None:
    """Close every session, concurrently; a close that cannot reach its server is left to finish
    in the background (the SDK stops retrying it after a few minutes)."""
    futures = []
    for client in clients:
        with contextlib.suppress(Exception):
            futures.append(client.close("success"))
    deadline = time.monotonic() + CLOSE_WAIT_S
    for future in futures:
        with contextlib.suppress(Exception):
            future.result(timeout=max(deadline - time.monotonic(), 0.01))
    clients.clear()


def _install() -> None:
    try:
        import tinker
    except ImportError:  # suites that never use the SDK
        return
    init = tinker.ServiceClient.__init__
    if getattr(init, "_records_sessions", False):
        return

    def recording_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _record(self)

    recording_init._records_sessions = True  # type: ignore[attr-defined]
    tinker.ServiceClient.__init__ = recording_init  # type: ignore[method-assign]


_install()
