"""Crash tests: kill -9 the scheduler, the gateway and the training worker, or the Redis server,
during a two-tenant pipelined run; the SDK clients finish without errors and the final adapters
equal those of an uninterrupted run, so no step was lost or applied twice."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from lockstep.demo import quickstart_data
from tests.promql import scrape, total

from .conftest import API_KEY, SERVER_ERROR, Server, start_server, stop_server

POLL_ROUTE = "/api/v1/retrieve_futures"

pytestmark = pytest.mark.e2e
STEPS = 200
TENANTS = ((11, 4), (12, 8))  # (seed, rank)


def train(
    server: Server, on_step: Callable[[int], None] = lambda step: None, steps: int = STEPS
) -> list[str]:
    """Two tenants, pipelined (submit step k, then wait for step k-1); returns their final
    sampler-weight directories."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainers = [
        client.create_lora_training_client(
            base_model="Lockstep/tiny-qwen3", rank=rank, seed=seed
        ).result()
        for seed, rank in TENANTS
    ]
    data = quickstart_data(trainers[0].get_tokenizer())
    paths: list[str] = ["", ""]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            trainer, prev = trainers[i], None
            for step in range(steps):
                batch = [data[(step + i) % len(data)]]
                futures = (
                    trainer.forward_backward(batch, "cross_entropy"),
                    trainer.optim_step(types.AdamParams(learning_rate=1e-3)),
                )
                if prev is not None:
                    prev[0].result()
                    prev[1].result()
                prev = futures
                if i == 0:
                    on_step(step)
            assert prev is not None
            prev[0].result()
            prev[1].result()
            paths[i] = trainer.save_weights_for_sampler("final").result().path
        except BaseException as exc:  # surfaced below: the SDK must not see any error
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(trainers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert not errors, errors
    return paths


def adapter(server: Server, tinker_path: str) -> dict[str, np.ndarray]:
    run, _, name = tinker_path.removeprefix("tinker://").split("/")
    directory = server.data_dir / "checkpoints" / run / "sampler_weights" / name
    return load_file(str(directory / "adapter_model.safetensors"))


def serve_child(server: Server, module: str) -> psutil.Process:
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if module in " ".join(proc.cmdline()):
            return proc
    raise AssertionError(f"no {module} under lockstep serve")


def engine_pid(server: Server, engine: str = "trainer") -> int:
    pids = re.findall(rf"{engine} ready in process (\d+)", server.log())
    assert pids, f"the scheduler logs its {engine}'s pid"
    return int(pids[-1])


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    psutil.wait_procs([psutil.Process(pid)], timeout=10) if psutil.pid_exists(pid) else None


@pytest.fixture()
def fresh(tmp_path: Path):  # type: ignore[no-untyped-def]
    servers: list[Server] = []

    def make(name: str) -> Server:
        servers.append(start_server(tmp_path / name))
        return servers[-1]

    yield make
    for srv in servers:
        stop_server(srv)


def test_kill_scheduler_gateway_and_worker_mid_run(server: Server, fresh) -> None:  # type: ignore[no-untyped-def]
    # The uninterrupted run: on the session's server (tenants of their own; a tenant's numbers
    # do not depend on who else the server serves).
    reference = [adapter(server, p) for p in train(server)]

    stormy = fresh("stormy")
    rng = random.Random(7)
    victims = {
        rng.randrange(20, 60): "scheduler",
        rng.randrange(80, 120): "gateway",
        rng.randrange(140, 180): "worker",
    }
    killed: list[str] = []

    def on_step(step: int) -> None:
        victim = victims.get(step)
        if victim is None:
            return
        if victim == "worker":
            kill(engine_pid(stormy))
        else:
            kill(serve_child(stormy, f"lockstep.{victim}").pid)
        killed.append(victim)
        time.sleep(rng.random() * 0.5)

    survived = [adapter(stormy, p) for p in train(stormy, on_step)]
    assert killed == ["scheduler", "gateway", "worker"]
    log = stormy.log()
    assert "scheduler exited" in log and "gateway exited" in log
    assert "training engine died" in log or "restored" in log
    assert_same_adapters(reference, survived)


def assert_same_adapters(
    reference: list[dict[str, np.ndarray]], survived: list[dict[str, np.ndarray]]
) -> None:
    for ref, got in zip(reference, survived, strict=True):
        assert ref.keys() == got.keys()
        for key in ref:
            np.testing.assert_allclose(got[key], ref[key], atol=1e-5, err_msg=key)


REDIS_STEPS = 30
POLLED_TOKENS = 32
REQUESTS = "lockstep_http_request_duration_seconds_count"


def test_kill_redis_mid_run(server: Server, fresh) -> None:  # type: ignore[no-untyped-def]
    """kill -9 of the embedded Redis (twice): the supervisor restarts it on its port and data
    directory, it replays its append-only file, the scheduler's client reconnects (with backoff)
    and the clock carries on where it was; no step is lost or doubled."""
    reference = [adapter(server, p) for p in train(server, steps=REDIS_STEPS)]

    stormy = fresh("stormy")
    kills = {8: 0.0, 20: 0.3}  # step -> pause after the kill
    killed: list[int] = []

    def on_step(step: int) -> None:
        if step in kills:
            kill(serve_child(stormy, "valkey-server").pid)
            killed.append(step)
            time.sleep(kills[step])

    survived = [adapter(stormy, p) for p in train(stormy, on_step, steps=REDIS_STEPS)]
    assert killed == list(kills)
    log = stormy.log()
    assert log.count("redis exited") == len(kills), log[-5000:]
    # The outage looked like slow commands: no failed cycle, no 5xx, no error the SDK retried.
    assert "clock cycle failed" not in log, log[-5000:]
    assert not SERVER_ERROR.search(log), SERVER_ERROR.findall(log)
    assert_same_adapters(reference, survived)


def test_samples_on_the_session_poller_survive_a_scheduler_kill(fresh) -> None:  # type: ignore[no-untyped-def]
    """The SDK's session poller (retrieve_futures) rides out a scheduler restart: the queued
    samples run on the new scheduler and every future completes with its result."""
    srv = fresh("poller")
    client = tinker.ServiceClient(base_url=srv.base_url, api_key=API_KEY)
    sampler = client.create_sampling_client(base_model="Lockstep/tiny-qwen3").result()
    params = types.SamplingParams(max_tokens=POLLED_TOKENS, temperature=1.0, stop=[])
    # The sampling engine's process is stopped (SIGSTOP) until the scheduler is killed: every
    # sample is still pending at the kill, however fast the box.
    frozen = engine_pid(srv, "sampler")
    os.kill(frozen, signal.SIGSTOP)
    try:
        futures = [
            sampler.sample(types.ModelInput.from_ints([1 + i, 2, 3]), 1, params) for i in range(8)
        ]
        deadline = time.monotonic() + 60
        while (
            total(
                scrape(srv.base_url + "/metrics"), REQUESTS, route="/api/v1/asample", status="200"
            )
            < 8
        ):
            assert time.monotonic() < deadline, "the samples did not reach the server"
            time.sleep(0.1)
        kill(serve_child(srv, "lockstep.scheduler").pid)
        assert not any(f.future().done() for f in futures), "done before the kill"
    finally:
        os.kill(frozen, signal.SIGCONT)  # orphaned by the kill: it exits
    for future in futures:
        assert len(future.result(timeout=240).sequences[0].tokens) == POLLED_TOKENS
    assert "scheduler exited" in srv.log()
    polls = scrape(srv.base_url + "/metrics")  # the gateway lived through it: its counts too
    assert total(polls, "lockstep_http_request_duration_seconds_count", route=POLL_ROUTE) > 0
