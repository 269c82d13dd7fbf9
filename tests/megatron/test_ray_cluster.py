"""`lockstep serve --engine megatron --tp 2 --ray-address …` on a real two-node Ray cluster.

Two Ray nodes on this machine (Ray's own multi-node test utility, tests/megatron/two_node_ray.py),
each with one CPU and its own resource; the server joins the cluster as a driver and places one
rank on each node (`--ray-placement STRICT_SPREAD`). Training through the real SDK must give the
local engine's numbers, and every Ray process (and the server's) must listen on loopback only.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.devserver import Server, start_server, stop_server
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.supervisor import free_port
from lockstep.workers.local.trainer import LocalTrainingEngine

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1"}
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range
STEPS = 2
RANK, SEED, LR = 8, 3, 1e-2


@dataclass
class RayCluster:
    proc: subprocess.Popen[str]
    address: str
    nodes: list[str]
    tmp: Path

    def actors(self) -> list[dict[str, Any]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("actors\n")
        self.proc.stdin.flush()
        table: list[dict[str, Any]] = json.loads(self.proc.stdout.readline())
        return table

    def processes(self) -> list[psutil.Process]:
        """Every Ray process of this cluster (their command lines name its private temp dir)."""
        found = []
        for p in psutil.process_iter(["cmdline"]):
            if any(str(self.tmp) in arg for arg in p.info["cmdline"] or ()):
                found.append(p)
        return found


def _head_port() -> int:
    while (port := free_port()) in RAY_WORKER_PORTS:
        pass
    return port


@pytest.fixture(scope="module")
def ray_env() -> Iterator[dict[str, str]]:
    tmp = tempfile.mkdtemp(prefix="lsray-", dir="/tmp")  # short: Ray's unix socket paths
    yield {
        "RAY_TMPDIR": tmp,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node IP 127.0.0.1, gRPC on 127.0.0.1 only
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
    }
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(ray_env: dict[str, str]) -> Iterator[RayCluster]:
    env = {**os.environ, **ray_env, "PYTHONPATH": os.pathsep.join([str(REPO), *sys.path])}
    log = open(Path(ray_env["RAY_TMPDIR"]) / "cluster.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.megatron.two_node_ray", str(_head_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=REPO,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(30)
        log.close()
        pytest.fail("the Ray cluster did not start:\n" + Path(log.name).read_text()[-5000:])
    info = json.loads(line)
    c = RayCluster(proc, info["address"], info["nodes"], Path(ray_env["RAY_TMPDIR"]))
    try:
        yield c
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the helper shuts the cluster down
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        for p in c.processes():  # whatever outlived the shutdown, by its own pid
            p.kill()
        log.close()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model(Path.home() / ".cache" / "lockstep-test-models")


@pytest.fixture(scope="module")
def server(
    cluster: RayCluster,
    ray_env: dict[str, str],
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as mp:  # the server's Ray driver: same cluster settings
        for key, value in ray_env.items():
            mp.setenv(key, value)
        srv = start_server(
            tmp_path_factory.mktemp("ray-cluster") / "data",
            "--engine",
            "megatron",
            "--tp",
            "2",
            "--ray-address",
            cluster.address,
            "--ray-placement",
            "STRICT_SPREAD",
            "--model",
            f"{DEFAULT_MODEL_NAME}={model_dir}",
        )
    yield srv
    code = stop_server(srv)
    assert code == 0, srv.log()[-5000:]


def _sdk_run(server: Server) -> list[dict[str, Any]]:
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-ray-cluster")
    trainer = client.create_lora_training_client(
        base_model=DEFAULT_MODEL_NAME, rank=RANK, seed=SEED
    ).result()
    data = quickstart_data(trainer.get_tokenizer())
    steps = []
    for _ in range(STEPS):
        fb = trainer.forward_backward(data, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=LR))
        result = fb.result()
        opt.result()
        steps.append(
            {
                "loss": result.metrics["loss:sum"],
                "logprobs": [o["logprobs"].to_numpy() for o in result.loss_fn_outputs],
                "data": data,
            }
        )
    return steps


def _local_run(model_dir: Path, data: list[Any]) -> list[dict[str, Any]]:
    """The same requests on the local engine, in process (what `--engine local` runs)."""
    engine = LocalTrainingEngine(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    engine.create_model("m", LoraSpec(rank=RANK, alpha=32.0, seed=SEED))
    datums = [
        Datum(
            np.asarray(d.model_input.to_ints(), np.int64),
            {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()},
        )
        for d in data
    ]
    steps = []
    for step in range(STEPS):
        (result,) = engine.run_passes(
            [PassRequest(f"r{step}", "m", "cross_entropy", {}, False, datums)]
        )
        engine.optim_step([OptimRequest("m", AdamConfig(learning_rate=LR))])
        steps.append(
            {
                "loss": result.metrics["loss:sum"],
                "logprobs": [o["logprobs"] for o in result.outputs],
            }
        )
    return steps


def test_two_node_cluster_trains_like_the_local_engine(
    cluster: RayCluster, server: Server, model_dir: Path
) -> None:
    assert len(cluster.nodes) == 2
    assert f"Connecting to existing Ray cluster at address: {cluster.address}" in server.log()
    got = _sdk_run(server)

    # One rank on each node.
    ranks = [a for a in cluster.actors() if a["class"] == "_RankActor" and a["state"] == "ALIVE"]
    assert len(ranks) == 2 and {a["node"] for a in ranks} == set(cluster.nodes), ranks

    # Every Ray process of the cluster and of the server listens on loopback only.
    server_tree = psutil.Process(server.proc.pid).children(recursive=True)
    ray_procs = cluster.processes()
    assert len(ray_procs) >= 4, "gcs, two raylets, workers"
    listening = [
        (p.pid, p.name(), c.laddr)
        for p in [*ray_procs, *server_tree]
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert listening and all(addr.ip in LOOPBACK for _, _, addr in listening), listening

    want = _local_run(model_dir, got[0]["data"])
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), step
        for gl, wl in zip(g["logprobs"], w["logprobs"], strict=True):
            np.testing.assert_allclose(gl, wl, atol=1e-5, err_msg=f"step {step}")
