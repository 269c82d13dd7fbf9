"""A Megatron rank (a Ray actor) killed with SIGKILL mid-run: the scheduler sees the group fail
(RayActorError -> EngineDied), restarts the trainer (a fresh Ray runtime and worker group),
restores the model from its last snapshot plus replay log and re-runs the cycle; the SDK client
finishes without an error and its adapter equals an undisturbed run's.

`lockstep serve --engine megatron --tp 2` (two megatron-core ranks, gloo on CPU), the real SDK.
The reference is a second tenant of the same server with the same seed, trained first: numbers do
not depend on who else is in the cycle.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.devserver import Server, start_server, stop_server
from tests.integration.conftest import API_KEY, SERVER_ERROR

pytestmark = pytest.mark.e2e
STEPS = 6
KILL_AT = 3
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[Server]:
    os.environ["HF_HUB_OFFLINE"] = "1"
    srv = start_server(tmp_path / "data", "--engine", "megatron", "--tp", "2")
    yield srv
    stop_server(srv)


def rank_processes(server: Server) -> list[psutil.Process]:
    procs = []
    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if "_RankActor" in " ".join(proc.cmdline()):
                procs.append(proc)
        except psutil.NoSuchProcess:
            continue
    return procs


def train(
    server: Server, trainer: tinker.TrainingClient, kill_at: int | None = None
) -> dict[str, np.ndarray]:
    data = quickstart_data(trainer.get_tokenizer())
    prev = None
    for step in range(STEPS):
        futures = (
            trainer.forward_backward([data[step % len(data)]], "cross_entropy"),
            trainer.optim_step(ADAM),
        )
        if prev is not None:
            prev[0].result()
            prev[1].result()
        prev = futures
        if step == kill_at:
            victims = rank_processes(server)
            assert len(victims) == 2, victims  # tp=2: two ranks
            os.kill(victims[-1].pid, signal.SIGKILL)
    assert prev is not None
    prev[0].result()
    prev[1].result()
    path = trainer.save_weights_for_sampler("final").result().path
    run, _, name = path.removeprefix("tinker://").split("/")
    directory = server.data_dir / "checkpoints" / run / "sampler_weights" / name
    return load_file(str(directory / "adapter_model.safetensors"))


def test_killed_rank_rebuilds_the_group_and_reruns_the_cycle(server: Server) -> None:
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)

    def trainer() -> tinker.TrainingClient:
        return client.create_lora_training_client(
            base_model="Lockstep/tiny-qwen3", rank=4, seed=9
        ).result()

    reference = train(server, trainer())
    survived = train(server, trainer(), kill_at=KILL_AT)
    log = server.log()
    assert "a megatron rank died" in log, log[-5000:]
    assert "restored" in log, log[-5000:]
    assert not SERVER_ERROR.search(log), SERVER_ERROR.findall(log)
    assert reference.keys() == survived.keys()
    for key in reference:
        np.testing.assert_allclose(survived[key], reference[key], atol=1e-5, err_msg=key)
