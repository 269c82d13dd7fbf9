"""Bad input gets a clean user error and the server keeps serving; the `tinker` CLI works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def trainer(service_client: tinker.ServiceClient, base_model: str) -> tinker.TrainingClient:
    return service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=3
    ).result()


def _good_step(trainer: tinker.TrainingClient) -> float:
    data = quickstart_data(trainer.get_tokenizer())[:2]
    loss = trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    return float(loss)


def _error_text(exc: BaseException) -> str:
    return f"{exc} {getattr(exc, 'body', '')}"


def test_token_id_beyond_vocab_is_a_user_error(trainer: tinker.TrainingClient) -> None:
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10_000_000]),
        loss_fn_inputs={"target_tokens": [2, 3, 4]},
    )
    with pytest.raises(tinker.BadRequestError) as info:
        trainer.forward_backward([bad], "cross_entropy").result()
    assert "vocab" in _error_text(info.value) or "token" in _error_text(info.value)
    assert _good_step(trainer) > 0


def test_mismatched_loss_input_length_is_a_user_error(trainer: tinker.TrainingClient) -> None:
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.BadRequestError) as info:
        trainer.forward_backward([bad], "cross_entropy").result()
    assert "weights" in _error_text(info.value)
    assert _good_step(trainer) > 0


def test_unknown_loss_is_a_user_error(trainer: tinker.TrainingClient) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4]},
    )
    with pytest.raises(tinker.BadRequestError) as info:
        trainer.forward_backward([datum], "no_such_loss").result()  # type: ignore[arg-type]
    assert "no_such_loss" in _error_text(info.value) or "loss_fn" in _error_text(info.value)
    assert _good_step(trainer) > 0


def _cli(server: Server, *args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": API_KEY}
    tinker_cli = Path(sys.executable).with_name("tinker")
    proc = subprocess.run(
        [str(tinker_cli), *args], env=env, capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_tinker_cli_checkpoint_list_and_download(
    server: Server, trainer: tinker.TrainingClient, tmp_path: Path
) -> None:
    _good_step(trainer)
    path = trainer.save_state("for-cli").result().path
    listing = _cli(server, "--format", "json", "checkpoint", "list")
    assert path in listing, listing
    runs = _cli(server, "--format", "json", "run", "list")
    assert trainer.model_id in runs, runs
    _cli(server, "checkpoint", "download", path, "-o", str(tmp_path))
    files = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files, files
    config = json.loads(next(tmp_path.rglob("adapter_config.json")).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
