"""The `tinker` CLI (the SDK's console script) against a real `lockstep serve`: every checkpoint
and run command the cookbook's users reach for, in its JSON and table formats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e

OTHER_KEY = "tml-integration-other-tenant"


@dataclass
class Run:
    model_id: str
    state_path: str
    sampler_path: str


def tinker_cli(
    server: Server, *args: str, key: str = API_KEY, ok: bool = True, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key}
    exe = Path(sys.executable).with_name("tinker")
    proc = subprocess.run(
        [str(exe), *args], env=env, capture_output=True, text=True, timeout=300, cwd=cwd
    )
    if ok:
        assert proc.returncode == 0, f"tinker {' '.join(args)}:\n{proc.stdout}{proc.stderr}"
    return proc


def cli_json(server: Server, *args: str, key: str = API_KEY) -> Any:
    return json.loads(tinker_cli(server, "--format", "json", *args, key=key).stdout)


@pytest.fixture(scope="module")
def run(service_client: tinker.ServiceClient, base_model: str) -> Run:
    trainer = service_client.create_lora_training_client(
        base_model=base_model, rank=4, user_metadata={"purpose": "cli-test"}
    ).result()
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={"target_tokens": [2, 3, 4, 5]},
    )
    trainer.forward_backward([datum], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return Run(
        trainer.model_id,
        trainer.save_state("cli-state").result().path,
        trainer.save_weights_for_sampler("cli-sampler").result().path,
    )


def test_run_list_and_info(server: Server, run: Run) -> None:
    listed = cli_json(server, "run", "list", "--limit", "0")["runs"]
    runs = {r["training_run_id"]: r for r in listed}
    assert run.model_id in runs, runs
    info = cli_json(server, "run", "info", run.model_id)
    assert info["training_run_id"] == run.model_id
    assert (info["is_lora"], info["lora_rank"], info["corrupted"]) == (True, 4, False)
    assert info["user_metadata"] == {"purpose": "cli-test"}
    assert info["last_checkpoint"]["tinker_path"] == run.state_path
    assert info["last_sampler_checkpoint"]["tinker_path"] == run.sampler_path
    table = tinker_cli(server, "run", "list", "--columns", "id,model,lora,status").stdout
    assert "Rank 4" in table and run.model_id in table
    # Another tenant sees none of it.
    assert run.model_id not in {
        r["training_run_id"] for r in cli_json(server, "run", "list", key=OTHER_KEY)["runs"]
    }
    assert tinker_cli(server, "run", "info", run.model_id, key=OTHER_KEY, ok=False).returncode


def test_checkpoint_list_and_info(server: Server, run: Run) -> None:
    listed = cli_json(server, "checkpoint", "list", "--run-id", run.model_id)
    by_path = {c["tinker_path"]: c for c in listed["checkpoints"]}
    assert by_path[run.state_path]["checkpoint_type"] == "training"
    assert by_path[run.sampler_path]["checkpoint_type"] == "sampler"
    everywhere = cli_json(server, "checkpoint", "list", "--limit", "0")
    assert {run.state_path, run.sampler_path} <= {
        c["tinker_path"] for c in everywhere["checkpoints"]
    }
    info = cli_json(server, "checkpoint", "info", run.state_path)
    assert (info["checkpoint_id"], info["public"], info["expires_at"]) == (
        "weights/cli-state",
        False,
        None,
    )
    assert (info["is_lora"], info["lora_rank"]) == (True, 4) and info["size_bytes"] > 0
    assert "Rank 4" in tinker_cli(server, "checkpoint", "info", run.sampler_path).stdout


def test_checkpoint_publish_and_unpublish(server: Server, run: Run) -> None:
    other = tinker.ServiceClient(base_url=server.base_url, api_key=OTHER_KEY)
    prompt = types.ModelInput.from_ints([1, 2, 3])

    def other_can_sample() -> bool:
        try:
            other.create_sampling_client(model_path=run.sampler_path).result().compute_logprobs(
                prompt
            ).result()
        except tinker.NotFoundError:
            return False
        return True

    assert not other_can_sample()
    tinker_cli(server, "checkpoint", "publish", run.sampler_path)
    assert cli_json(server, "checkpoint", "info", run.sampler_path)["public"] is True
    assert other_can_sample()
    tinker_cli(server, "checkpoint", "unpublish", run.sampler_path)
    assert cli_json(server, "checkpoint", "info", run.sampler_path)["public"] is False
    assert not other_can_sample()
    # Only the owner may publish.
    assert tinker_cli(
        server, "checkpoint", "publish", run.sampler_path, key=OTHER_KEY, ok=False
    ).returncode


def test_checkpoint_set_ttl(server: Server, run: Run) -> None:
    tinker_cli(server, "checkpoint", "set-ttl", run.state_path, "--ttl", "7200")
    assert cli_json(server, "checkpoint", "info", run.state_path)["expires_at"] is not None
    tinker_cli(server, "checkpoint", "set-ttl", run.state_path, "--remove")
    assert cli_json(server, "checkpoint", "info", run.state_path)["expires_at"] is None


def test_checkpoint_download(server: Server, run: Run, tmp_path: Path) -> None:
    tinker_cli(server, "checkpoint", "download", run.state_path, "--output", str(tmp_path))
    files = {p.name: p for p in tmp_path.rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(files), files
    config = json.loads(files["adapter_config.json"].read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4


def test_checkpoint_delete(
    server: Server, service_client: tinker.ServiceClient, base_model: str
) -> None:
    trainer = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    doomed = [
        trainer.save_state("doomed").result().path,
        trainer.save_weights_for_sampler("doomed-sampler").result().path,
    ]
    kept = trainer.save_state("kept").result().path
    # Another tenant cannot delete it (the CLI reports the 404 per path and exits 0).
    refused = tinker_cli(server, "checkpoint", "delete", "-y", doomed[0], key=OTHER_KEY, ok=False)
    assert "404" in refused.stdout + refused.stderr
    assert cli_json(server, "checkpoint", "info", doomed[0])["checkpoint_id"] == "weights/doomed"
    tinker_cli(server, "checkpoint", "delete", "-y", *doomed)
    left = {
        c["tinker_path"]
        for c in cli_json(server, "checkpoint", "list", "--run-id", trainer.model_id)["checkpoints"]
    }
    assert left == {kept}
    gone = tinker_cli(server, "checkpoint", "info", doomed[0], ok=False)
    assert gone.returncode != 0 and "not found" in (gone.stdout + gone.stderr).lower()
    tinker_cli(server, "checkpoint", "delete", "-y", "--run-id", trainer.model_id)
    assert cli_json(server, "checkpoint", "list", "--run-id", trainer.model_id)["checkpoints"] == []
