"""Session traces through the real SDK: `RestClient.export_session_trace` -> signed URL -> JSON.

A session trains (forward_backward + optim_step, pipelined), saves sampler weights and samples;
its trace must hold every request with its queue wait, the cycle it ran in and the dispatch
phases, the sampling batch of each sample, and the cycles on their own track, all well nested.
"""

from __future__ import annotations

import json
import stat
import urllib.error
import urllib.request
from collections import defaultdict
from typing import Any

import pytest
import tinker
from tinker import types

from lockstep import config
from lockstep.demo import quickstart_data

from .conftest import Server

pytestmark = pytest.mark.e2e
OTHER_KEY = "tml-trace-other-tenant"


def _download(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as response:  # no auth header, as the SDK says
        return json.loads(response.read())


def _nested(events: list[dict[str, Any]]) -> None:
    """On each (pid, tid) track, any two slices are disjoint or one contains the other."""
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        tracks[(e["pid"], e["tid"])].append(e)
    for track, slices in tracks.items():
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict[str, Any]] = []
        for e in slices:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                parent = stack[-1]
                assert e["ts"] + e["dur"] <= parent["ts"] + parent["dur"], (track, parent, e)
            stack.append(e)


def test_export_session_trace(server: Server, base_model: str) -> None:
    service = tinker.ServiceClient(base_url=server.base_url, api_key="tml-trace-tenant")
    trainer = service.create_lora_training_client(base_model=base_model, rank=8).result()
    data = quickstart_data(trainer.get_tokenizer())
    adam = types.AdamParams(learning_rate=1e-3)
    pending = [(trainer.forward_backward(data, "cross_entropy"), trainer.optim_step(adam))]
    pending.append((trainer.forward_backward(data, "cross_entropy"), trainer.optim_step(adam)))
    cycles = set()
    for fb, opt in pending:
        cycles.add(int(fb.result().metrics["clock_cycle:unique"]))
        opt.result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:8])
    sampler.sample(prompt, 2, types.SamplingParams(max_tokens=4)).result()

    session_id = service.holder.get_session_id()
    rest = tinker.RestClient(base_url=server.base_url, api_key="tml-trace-tenant")
    url = rest.export_session_trace(session_id).result()
    trace = _download(url)

    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    for e in slices:  # well formed Chrome-trace complete events
        assert isinstance(e["name"], str) and e["name"]
        assert isinstance(e["ts"], int) and isinstance(e["dur"], int) and e["dur"] >= 0
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
    _nested(slices)
    names = {(e["name"], e["args"]["name"]) for e in meta}
    model_id = f"{session_id}:train:0"
    assert ("process_name", model_id) in names and ("process_name", "clock") in names
    assert ("thread_name", "cycles") in names

    requests = [e for e in slices if e["name"].startswith("request ")]
    kinds = sorted(e["name"] for e in requests)
    assert kinds.count("request forward_backward") == 2 and kinds.count("request optim_step") == 2
    assert {"request create_model", "request save", "request sample"} <= set(kinds)
    by_track: dict[tuple[int, int], set[str]] = defaultdict(set)
    for e in slices:
        by_track[(e["pid"], e["tid"])].add(e["name"])
    for r in requests:
        inside = by_track[(r["pid"], r["tid"])]
        assert "queue wait" in inside, r
        if r["name"] == "request sample":
            assert "sampling batch" in inside
        else:
            assert f"cycle {r['args']['cycle']}" in inside
    fb_cycles = {r["args"]["cycle"] for r in requests if r["name"] == "request forward_backward"}
    assert fb_cycles == cycles  # the cycle the SDK was told is the one in the trace
    phase_names = set().union(*by_track.values())
    # No "snapshot": a run is snapshotted once per --snapshot-interval, not at every step.
    for phase in ("pass", "optimizer step", "save", "create_model"):
        assert phase in phase_names, phase
    clock_track = [e for e in slices if e["pid"] == 0]
    assert {f"cycle {c}" for c in cycles} <= {e["name"] for e in clock_track}

    # Another key's session is a 404, as every session route.
    other_rest = tinker.RestClient(base_url=server.base_url, api_key=OTHER_KEY)
    with pytest.raises(tinker.NotFoundError):
        other_rest.export_session_trace(session_id).result()
    # A tampered signature is refused.
    with pytest.raises(urllib.error.HTTPError) as refused:
        _download(url.replace("sig=", "sig=0"))
    assert refused.value.code == 403


def test_serve_wires_its_scheduler_on_a_unix_socket(server: Server) -> None:
    """The gateway every e2e request here goes through reaches its scheduler over the data
    dir's Unix socket (`--scheduler-transport unix`, the default), not loopback TCP."""
    wired = config.load(server.data_dir / "run" / "config.json")
    sock = server.data_dir.resolve() / "run" / "scheduler.sock"
    assert wired.gateway.scheduler_address == wired.scheduler.listen == f"unix:{sock}"
    assert stat.S_ISSOCK(sock.stat().st_mode)
