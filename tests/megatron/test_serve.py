"""End to end: `lockstep serve --engine megatron --tp 2` (two megatron-core ranks as Ray actors,
gloo on CPU) driven by the real tinker SDK: the Pig Latin quickstart, an RL loop, and
save_state / resume run unchanged against it and learn as on the local engine.

The test bodies are the integration suite's own (imported, so pytest collects them here with
this module's server fixture): same flows, same thresholds, a different training engine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from lockstep.devserver import Server, start_server, stop_server
from tests.integration.conftest import API_KEY
from tests.integration.test_quickstart import test_pig_latin_trains_and_samples
from tests.integration.test_rl_and_resume import (
    test_resume_with_and_without_optimizer,
    test_rl_loop_raises_reward_and_logprobs_agree,
)

pytestmark = pytest.mark.e2e

__all__ = [
    "test_pig_latin_trains_and_samples",
    "test_resume_with_and_without_optimizer",
    "test_rl_loop_raises_reward_and_logprobs_agree",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    os.environ.setdefault("TINKER_API_KEY", API_KEY)
    os.environ["HF_HUB_OFFLINE"] = "1"
    data_dir: Path = tmp_path_factory.mktemp("lockstep-megatron") / "data"
    srv = start_server(data_dir, "--engine", "megatron", "--tp", "2")
    assert "Started a local Ray instance" in srv.log(), srv.log()[-3000:]  # the megatron engine
    yield srv
    code = stop_server(srv)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{srv.log()[-5000:]}"


@pytest.fixture(scope="module")
def service_client(server: Server):  # type: ignore[no-untyped-def]
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="module")
def base_model() -> str:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def test_cp_without_transformer_engine_fails_at_startup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lockstep serve --engine megatron --cp 2` exits before starting anything with a usage
    error (exit code 2) that names --cp and what it needs."""
    from lockstep.cli import main
    from lockstep.modeling.tiny import ensure_default_model

    model = ensure_default_model(Path.home() / ".cache" / "lockstep-test-models")
    for flags, named in (
        (["--cp", "2"], "--cp"),
        (["--tp", "2", "--sequence-parallel"], "--sequence-parallel"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    "serve",
                    "--data-dir",
                    str(tmp_path),
                    "--model",
                    str(model),
                    "--engine",
                    "megatron",
                    *flags,
                ]
            )
        assert exit_info.value.code == 2
        assert f"{named} needs NVIDIA Transformer Engine" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--data-dir", str(tmp_path), "--model", str(model), "--tp", "2"])
    assert exit_info.value.code == 2
    assert "need --engine megatron" in capsys.readouterr().err
