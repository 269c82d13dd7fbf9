"""Upgrades (docs/operations.md, "Versions and upgrades").

The previous release is the newest one CHANGELOG.md names with its commit, built from that
commit into a cached environment of its own (tests/release_env.py), so this keeps testing
"previous release -> this code" as releases are cut. On it two tenants train through the real
SDK, save their state, take sampler checkpoints, and leave futures pending (submitted to a server
whose clock is held by a day-long --clock-gather, then stopped). This code then starts on the
same data directory (and the embedded Redis in it) and port: every pending future completes,
each run goes on and its losses equal an uninterrupted run's, every checkpoint loads (a state's
forward equals the loss the run had at that step; a sampler checkpoint's greedy sample equals
the one taken before the upgrade, or an uninterrupted run's). Meanwhile the gateway and then the
scheduler are restarted one at a time under load: no SDK call fails.

A start on state this code does not serve (a newer format) exits with status 3 and a message
naming both versions, and changes nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import redis
import tinker
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.devserver import Server, start_server, stop_server
from lockstep.ports import free_port
from lockstep.supervisor import redis_binary
from lockstep.version import STATE_FORMAT, VERSION
from tests.changelog import ROOT, Release, previous_release
from tests.promql import scrape, total
from tests.release_env import release_python

from .conftest import API_KEY

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]
BASE = "Lockstep/tiny-qwen3"
TENANTS = ((21, 4), (22, 8))  # (seed, rank)
BEFORE = 3  # steps on the previous release before it stops
PENDING = 2  # steps left pending (with a sampler save and a state save) when it stops again
ADAM = types.AdamParams(learning_rate=2e-3)
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0)
WAIT_S = 600


@pytest.fixture(scope="module")
def previous() -> tuple[Release, Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the upgrade from the previous release is NOT tested")
    release = previous_release()
    assert release is not None, "CHANGELOG.md names no release commit to upgrade from"
    return release, release_python(release)


def health(server: Server) -> dict[str, Any]:
    with urllib.request.urlopen(server.base_url + "/api/v1/healthz", timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def step(trainer: Any, data: list[Any], k: int, i: int) -> tuple[Any, Any]:
    """Step `k` of tenant `i`: its forward_backward and optim_step futures."""
    batch = [data[(k + i) % len(data)]]
    return trainer.forward_backward(batch, "cross_entropy"), trainer.optim_step(ADAM)


def greedy(service: tinker.ServiceClient, path: str, prompt: types.ModelInput) -> list[int]:
    sampler = service.create_sampling_client(model_path=path).result()
    out = sampler.sample(prompt=prompt, num_samples=1, sampling_params=GREEDY)
    return list(out.result(timeout=WAIT_S).sequences[0].tokens)


def submitted(server: Server) -> float:
    """Training submissions the gateway accepted so far."""
    found = scrape(server.base_url + "/metrics")
    routes = ("forward_backward", "optim_step", "save_weights_for_sampler", "save_weights")
    name = "lockstep_http_request_duration_seconds_count"
    return sum(total(found, name, route=f"/api/v1/{r}", status="200") for r in routes)


def child(server: Server, module: str) -> psutil.Process:
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        if f"-m {module}" in " ".join(proc.cmdline()):
            return proc
    raise AssertionError(f"no {module} under lockstep serve")


def restart(server: Server, module: str) -> None:
    """Stop one process of the deployment (SIGTERM, as a rolling update does); `lockstep serve`
    starts it again. Returns once the new one serves."""
    old = child(server, module)
    old.send_signal(signal.SIGTERM)
    old.wait(120)
    deadline = time.monotonic() + WAIT_S
    while True:
        assert time.monotonic() < deadline, f"{module} did not come back"
        try:
            if child(server, module).pid != old.pid and health(server)["status"] == "ok":
                return
        except (AssertionError, OSError, psutil.Error):
            pass
        time.sleep(0.5)


def test_an_upgrade_from_the_previous_release_keeps_every_run(
    previous: tuple[Release, Path], tmp_path: Path
) -> None:
    release, python = previous
    data_dir, port = tmp_path / "data", free_port()

    # The previous release: train, save, take sampler checkpoints, stop.
    old = start_server(data_dir, python=python, port=port)
    try:
        assert health(old)["version"] == release.version
        service = tinker.ServiceClient(base_url=old.base_url, api_key=API_KEY)
        trainers = [
            service.create_lora_training_client(base_model=BASE, rank=rank, seed=seed).result()
            for seed, rank in TENANTS
        ]
        data = quickstart_data(trainers[0].get_tokenizer())
        prompt = data[0].model_input
        losses: list[list[float]] = [[], []]
        for k in range(BEFORE):
            futures = [step(t, data, k, i) for i, t in enumerate(trainers)]
            for i, (fb, optim) in enumerate(futures):
                losses[i].append(fb.result(timeout=WAIT_S).metrics["loss:sum"])
                optim.result(timeout=WAIT_S)
        states = [t.save_state("before").result(timeout=WAIT_S).path for t in trainers]
        samplers = [t.save_weights_for_sampler("before").result().path for t in trainers]
        sampled_before = [greedy(service, path, prompt) for path in samplers]
    finally:
        assert stop_server(old) == 0, old.log()[-5000:]

    # The previous release again, its clock held: what is submitted stays queued, then it stops.
    old = start_server(data_dir, "--clock-gather", "86400", python=python, port=port)
    try:
        accepted = submitted(old)
        pending = []
        for i, trainer in enumerate(trainers):
            steps = [step(trainer, data, BEFORE + j, i) for j in range(PENDING)]
            pending.append(
                (
                    steps,
                    trainer.save_weights_for_sampler("pending"),
                    trainer.save_state("pending"),
                )
            )
        want = accepted + len(trainers) * (2 * PENDING + 2)
        deadline = time.monotonic() + WAIT_S
        while submitted(old) < want:
            assert time.monotonic() < deadline, "the pending requests never reached the server"
            time.sleep(0.2)
    finally:
        assert stop_server(old) == 0, old.log()[-5000:]
    assert all(not fb.future().done() for steps, _, _ in pending for fb, _ in steps)

    # This code on the same data directory, Redis and port.
    head = start_server(data_dir, port=port)
    try:
        assert health(head)["version"] == VERSION
        if release.state_format < STATE_FORMAT:
            assert f"migrating state format {release.state_format} to {STATE_FORMAT}" in head.log()
        pending_states, pending_samplers = [], []
        for i, (steps, sampler_save, state_save) in enumerate(pending):
            for fb, optim in steps:
                losses[i].append(fb.result(timeout=WAIT_S).metrics["loss:sum"])
                optim.result(timeout=WAIT_S)
            pending_samplers.append(sampler_save.result(timeout=WAIT_S).path)
            pending_states.append(state_save.result(timeout=WAIT_S).path)

        _train_through_rolling_restarts(head, trainers, data, losses)

        # An uninterrupted run of each tenant on this code: the same losses, step for step.
        reference = [
            service.create_lora_training_client(base_model=BASE, rank=rank, seed=seed).result()
            for seed, rank in TENANTS
        ]
        uninterrupted: list[list[float]] = [[], []]
        reference_samplers = []
        for k in range(max(len(run) for run in losses)):
            futures = [
                step(t, data, k, i) if k < len(losses[i]) else None for i, t in enumerate(reference)
            ]
            for i, pair in enumerate(futures):
                if pair is not None:
                    uninterrupted[i].append(pair[0].result(timeout=WAIT_S).metrics["loss:sum"])
                    pair[1].result(timeout=WAIT_S)
            if k + 1 == BEFORE + PENDING:
                reference_samplers = [t.save_weights_for_sampler("ref").result() for t in reference]
        for i in range(len(TENANTS)):
            np.testing.assert_allclose(losses[i], uninterrupted[i], rtol=1e-5, atol=1e-6)

        # Every checkpoint loads: a state's forward is the loss its run had at that step; a
        # sampler checkpoint samples what it sampled before the upgrade (or what an
        # uninterrupted run's does).
        for i in range(len(TENANTS)):
            for path, k in ((states[i], BEFORE), (pending_states[i], BEFORE + PENDING)):
                loaded = service.create_training_client_from_state(path).result()
                batch = [data[(k + i) % len(data)]]
                forward = loaded.forward(batch, "cross_entropy").result(timeout=WAIT_S)
                assert forward.metrics["loss:sum"] == pytest.approx(losses[i][k], rel=1e-5)
            assert greedy(service, samplers[i], prompt) == sampled_before[i]
            assert greedy(service, pending_samplers[i], prompt) == greedy(
                service, reference_samplers[i].path, prompt
            )
    finally:
        code = stop_server(head)
    assert code == 0, head.log()[-5000:]


def _train_through_rolling_restarts(
    server: Server, trainers: list[Any], data: list[Any], losses: list[list[float]]
) -> None:
    """Both tenants keep stepping (pipelined) while the gateway, then the scheduler, restart;
    every SDK call must succeed, and each tenant steps before and after each restart."""
    done = threading.Event()
    errors: list[BaseException] = []

    def train(i: int) -> None:
        try:
            trainer, prev = trainers[i], None
            while not done.is_set():
                futures = step(trainer, data, len(losses[i]) + (prev is not None), i)
                if prev is not None:
                    losses[i].append(prev[0].result(timeout=WAIT_S).metrics["loss:sum"])
                    prev[1].result(timeout=WAIT_S)
                prev = futures
            assert prev is not None
            losses[i].append(prev[0].result(timeout=WAIT_S).metrics["loss:sum"])
            prev[1].result(timeout=WAIT_S)
        except BaseException as exc:  # surfaced below: no SDK call may fail
            errors.append(exc)

    def steps_done() -> list[int]:
        return [len(run) for run in losses]

    def after(marks: list[int], more: int = 2) -> Callable[[], bool]:
        return lambda: all(n >= m + more for n, m in zip(steps_done(), marks, strict=True))

    threads = [threading.Thread(target=train, args=(i,)) for i in range(len(trainers))]
    for t in threads:
        t.start()
    try:
        _wait(after(steps_done()), errors)
        for module in ("lockstep.gateway", "lockstep.scheduler"):
            restart(server, module)
            _wait(after(steps_done()), errors)  # both tenants step on the restarted process
    finally:
        done.set()
        for t in threads:
            t.join(WAIT_S)
    assert not errors, errors


def _wait(condition: Callable[[], bool], errors: list[BaseException]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert not errors, errors
        assert time.monotonic() < deadline, "the tenants stopped stepping"
        time.sleep(0.2)


# ---------------------------------------------------------------- a start it refuses
@pytest.fixture()
def stamped_newer(tmp_path: Path) -> Iterator[tuple[Path, bytes]]:
    """A data directory whose embedded Redis holds state stamped with a newer format."""
    data_dir = tmp_path / "data"
    redis_dir = data_dir / "redis"
    redis_dir.mkdir(parents=True)
    stamp = json.dumps({"format": STATE_FORMAT + 1, "written_by": "99.0.0"}).encode()
    with _redis_on(redis_dir) as client:
        client.set("ls:format", stamp)
        client.set("ls:model:run-1", b"{}")
    (data_dir / "state" / "run-1").mkdir(parents=True)
    yield data_dir, stamp


class _redis_on:  # noqa: N801 (a context manager used like a function)
    """The embedded Redis's binary and persistence on `directory`, as `lockstep serve` runs it."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        argv = [redis_binary(), "--port", str(self.port), "--dir", str(directory)]
        argv += ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)

    def __enter__(self) -> redis.Redis:
        for _ in range(200):
            try:
                self.client.ping()
                return self.client
            except redis.ConnectionError:
                time.sleep(0.05)
        raise AssertionError("redis did not start")

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def test_a_newer_state_format_is_refused_untouched(stamped_newer: tuple[Path, bytes]) -> None:
    data_dir, stamp = stamped_newer
    files = sorted(p.relative_to(data_dir) for p in (data_dir / "state").rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "serve", "--data-dir", str(data_dir)]
        + ["--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    said = proc.stderr
    assert f"state format {STATE_FORMAT + 1}, written by Lockstep 99.0.0" in said, said[-3000:]
    assert f"this is Lockstep {VERSION}" in said and "Nothing was changed" in said
    assert "started scheduler" not in said  # refused before the engines start
    with _redis_on(data_dir / "redis") as client:
        assert client.get("ls:format") == stamp
        assert sorted(client.keys("*")) == [b"ls:format", b"ls:model:run-1"]
    assert not (data_dir / "STATE_FORMAT").exists()
    assert sorted(p.relative_to(data_dir) for p in (data_dir / "state").rglob("*")) == files
