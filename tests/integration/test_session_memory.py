"""Finished sessions give their memory back: sessions one after another each create a rank-32
run, train two steps, sample and close; the trainer's and the sampler's RSS after the last is
within 1.15x of after the tenth, every run was freed, and a freed run's checkpoint still loads.

The counts are parameters: CI runs LOCKSTEP_TENANCY_SESSIONS=20 on the built-in model (about a
minute here). The full check of the issue is 200 sessions on the built-in model and 40 on
SmolLM2-135M (LOCKSTEP_TENANCY_SESSIONS=200; LOCKSTEP_TENANCY_MODEL=NAME=DIR serves a real model).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.supervisor import free_port
from tests.promql import scrape, total

from .conftest import Server, start_server, stop_server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]  # scales with the session count

SESSIONS = int(os.environ.get("LOCKSTEP_TENANCY_SESSIONS", "20"))
BASELINE_AFTER = 10
MODEL = os.environ.get("LOCKSTEP_TENANCY_MODEL")  # NAME=DIR; default: the built-in model


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, int]]:
    port = free_port()
    extra = ["--metrics-port", str(port)] + (["--model", MODEL] if MODEL else [])
    srv = start_server(tmp_path_factory.mktemp("memory") / "data", *extra)
    yield srv, port
    assert stop_server(srv) == 0, srv.log()[-3000:]


def _engine_processes(server: Server) -> list[psutil.Process]:
    """The scheduler's engine children (trainer and sampler; spawned Python processes)."""
    root = psutil.Process(server.proc.pid)
    (scheduler,) = [p for p in root.children() if "lockstep.scheduler" in " ".join(p.cmdline())]
    engines = [p for p in scheduler.children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(engines) == 2, [p.cmdline() for p in engines]
    return engines


def _metric(port: int, name: str, **labels: str) -> float:
    return total(scrape(f"http://127.0.0.1:{port}/metrics"), name, **labels)


def _session(server: Server, base_model: str, i: int) -> str:
    client = tinker.ServiceClient(base_url=server.base_url, api_key=f"tml-mem-{i}")
    trainer = client.create_lora_training_client(base_model=base_model, rank=32, seed=i).result()
    tok = trainer.get_tokenizer()
    data = quickstart_data(tok)[:2]
    for _ in range(2):
        fb = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        fb.result()
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("hello"))
    assert sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4)).result().sequences
    path = trainer.save_state("final").result().path
    client.close("success").result()
    return path


def _wait_freed(port: int, freed: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if _metric(port, "lockstep_model_pages_total", direction="freed") >= freed:
            return
        time.sleep(0.2)
    raise AssertionError(f"expected {freed} runs freed")


def test_closed_sessions_give_their_memory_back(
    served: tuple[Server, int], base_model: str
) -> None:
    server, port = served
    model = MODEL.split("=", 1)[0] if MODEL else base_model
    engines = _engine_processes(server)
    paths: list[str] = []
    baseline: list[int] = []
    for i in range(SESSIONS):
        paths.append(_session(server, model, i))
        _wait_freed(port, i + 1)
        if i + 1 == BASELINE_AFTER:
            baseline = [p.memory_info().rss for p in engines]
    final = [p.memory_info().rss for p in engines]
    assert _metric(port, "lockstep_resident_models") == 0
    ratios = [f / b for f, b in zip(final, baseline, strict=True)]
    print(f"{SESSIONS} sessions on {model}: trainer, sampler RSS after the last / after the tenth")
    print(f"  {[round(r, 3) for r in ratios]} ({baseline} -> {final} bytes)")
    assert max(ratios) <= 1.15, f"engine RSS grew {ratios} ({baseline} -> {final})"

    # the freed run's checkpoint still loads, into a new session
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-mem-0")
    resumed: Any = client.create_training_client_from_state(paths[0]).result()
    data = quickstart_data(resumed.get_tokenizer())[:1]
    assert resumed.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0
    client.close("success").result()
