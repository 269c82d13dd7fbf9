"""Whether tenants' passes that were waiting together ran in one clock cycle, read from the
session trace (when each request was queued, when each cycle began planning), so the check
holds on a machine of any speed."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def _download(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:  # no auth header, as the SDK says
        return json.loads(response.read())


def assert_packed(base_url: str, api_key: str, session_id: str, rounds: list[list[int]]) -> None:
    """Each round's passes (their `clock_cycle:unique`) ran in one cycle, unless a later one
    reached the scheduler only after the cycle before it had begun planning (a busy machine can
    spread the submissions that far). Fails whenever the scheduler ran some tenants' passes
    without another's that was already waiting."""
    import tinker

    rest = tinker.RestClient(base_url=base_url, api_key=api_key)
    trace = _download(rest.export_session_trace(session_id).result())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    waits = {(e["pid"], e["tid"]): e["ts"] for e in events if e["name"] == "queue wait"}
    passes = [e for e in events if e["name"] == "request forward_backward"]
    planned = {e["args"]["cycle"]: e["args"]["planned_us"] for e in passes}
    for cycles in rounds:
        ran = sorted(set(cycles))
        for earlier, later in zip(ran, ran[1:], strict=False):
            for late in (e for e in passes if e["args"]["cycle"] == later):
                queued = waits.get((late["pid"], late["tid"]), late["ts"])
                assert queued >= planned[earlier], (
                    f"the tenants' passes ran in cycles {cycles} though one in cycle {later} "
                    f"was queued before cycle {earlier} was planned"
                )
