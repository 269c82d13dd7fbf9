"""A full disk: checkpoint writes fail clearly, no write leaves anything half-written, and the
model trains on, exactly once per step, when space is back.

A step's snapshot is written in the background (lockstep/workers/snapshots.py): the step does not
wait for it and does not fail when it cannot be written. It stays in the model's replay log
(Redis) until a later snapshot is durable, so nothing is lost; the failed write is logged.

The data directory's `state/` (per-step snapshots) and `checkpoints/` (named saves) are real
size-limited filesystems (tmpfs mounts of a few MB), filled up with a filler file while the
server runs; nothing is injected. Mounting needs root (or CAP_SYS_ADMIN): without it the test
is skipped.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from lockstep.demo import quickstart_data

from .conftest import API_KEY, SERVER_ERROR, Server, start_server, stop_server

pytestmark = pytest.mark.e2e
MOUNTS = ("state", "checkpoints")
SIZE = "4m"
LEFT_FREE = 48 * 1024  # less than one rank-4 snapshot (~300 KB)
ADAM = types.AdamParams(learning_rate=1e-3)
TIMEOUT = 120  # a failure must come back, not hang


def _mount(directory: Path) -> bool:
    directory.mkdir(parents=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(directory)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )


@pytest.fixture()
def small_disk_server(tmp_path: Path) -> Iterator[Server]:
    data = tmp_path / "data"
    mounted = []
    try:
        for name in MOUNTS:
            if not _mount(data / name):
                pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
            mounted.append(data / name)
        server = start_server(data, "--snapshot-interval", "0")  # every step writes one
        try:
            yield server
        finally:
            stop_server(server)
    finally:
        for directory in mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def settle(state: Path, timeout: float = 30.0) -> None:
    """Wait until every background snapshot is written and the older ones are pruned (one
    snapshot per model, nothing half-written), so no write or delete races the filler."""
    deadline, stable = time.monotonic() + timeout, 0
    while stable < 3:  # unchanged over three polls, longer than the idle durability tick
        assert time.monotonic() < deadline, sorted(str(p) for p in state.rglob("*"))
        models = [m for m in state.iterdir() if m.is_dir()]
        stable = stable + 1 if models and all(len(list(m.iterdir())) == 1 for m in models) else 0
        time.sleep(0.5)


def fill(directory: Path) -> Path:
    """Leave LEFT_FREE bytes free on `directory`'s filesystem."""
    import shutil

    filler = directory / "filler"
    free = shutil.disk_usage(directory).free
    with filler.open("wb") as f:
        f.write(b"\0" * max(free - LEFT_FREE, 0))
    assert shutil.disk_usage(directory).free <= LEFT_FREE + 8192
    return filler


def step(trainer: tinker.TrainingClient, datum: types.Datum) -> None:
    fb = trainer.forward_backward([datum], "cross_entropy")
    opt = trainer.optim_step(ADAM)
    fb.result(TIMEOUT)
    opt.result(TIMEOUT)


def weights(server: Server, trainer: tinker.TrainingClient, name: str) -> dict[str, np.ndarray]:
    path = trainer.save_weights_for_sampler(name).result(TIMEOUT).path
    run, _, ckpt = path.removeprefix("tinker://").split("/")
    directory = server.data_dir / "checkpoints" / run / "sampler_weights" / ckpt
    return load_file(str(directory / "adapter_model.safetensors"))


def test_disk_full_fails_clearly_and_training_resumes(small_disk_server: Server) -> None:
    server = small_disk_server
    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainer, reference = (
        client.create_lora_training_client(
            base_model="Lockstep/tiny-qwen3", rank=4, seed=5
        ).result()
        for _ in range(2)
    )
    data = quickstart_data(trainer.get_tokenizer())
    for t in (trainer, reference):
        step(t, data[0])
    step(reference, data[1])  # the run the disturbed one must end up equal to

    settle(server.data_dir / "state")
    fillers = [fill(server.data_dir / name) for name in MOUNTS]
    fb = trainer.forward_backward([data[1]], "cross_entropy")
    opt = trainer.optim_step(ADAM)
    fb.result(TIMEOUT)  # a pass writes nothing to disk
    opt.result(TIMEOUT)  # its snapshot fails in the background; the step is in the replay log
    with pytest.raises(tinker.RequestFailedError, match="out of disk space") as info:
        trainer.save_state("full").result(TIMEOUT)
    assert info.value.category.value == "server"  # final for the SDK: no retry loop, no 5xx
    run_dir = server.data_dir / "checkpoints" / trainer.model_id / "weights"
    assert not run_dir.exists() or sorted(p.name for p in run_dir.iterdir()) == [], "half-written"
    state_dir = server.data_dir / "state" / trainer.model_id
    partial = [p.name for p in state_dir.iterdir() if p.name.startswith(".") or "tmp" in p.name]
    assert not partial, f"half-written snapshots: {partial}"
    rest = tinker.RestClient(base_url=server.base_url, api_key=API_KEY)
    listed = rest.list_checkpoints(trainer.model_id).result(TIMEOUT).checkpoints
    assert not [c for c in listed if c.tinker_path.endswith("/full")], listed

    for filler in fillers:  # space is back
        filler.unlink()
    assert trainer.save_state("full").result(TIMEOUT).path.endswith("/full")
    got, want = weights(server, trainer, "after"), weights(server, reference, "after")
    assert got.keys() == want.keys()
    for key in want:  # every step applied exactly once
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    for t in (trainer, reference):  # and the model trains on, its snapshots durable again
        step(t, data[2])
    got, want = weights(server, trainer, "later"), weights(server, reference, "later")
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
    log = server.log()
    assert "background snapshot" in log and "No space left on device" in log
    assert "clock cycle failed" not in log, log[-5000:]
    assert not SERVER_ERROR.search(log), SERVER_ERROR.findall(log)
