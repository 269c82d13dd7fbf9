"""`--max-resident-models 4` with 12 concurrent pipelined tenants: every request finishes, no
errors, and every final adapter equals the same tenants' run on a server without the limit
(fp32 <= 1e-5). The same server (one start, to keep the suite short) ends a session that stops
sending heartbeats, takes its keys from a `--keys-file` it re-reads on SIGHUP, and `lockstep
admin` reports per key from its Redis."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from lockstep.demo import quickstart_data
from lockstep.keyring import owner_of
from lockstep.supervisor import free_port
from tests.promql import samples, scrape

from .conftest import Server, start_server, stop_server

# two servers start in the first test's setup; generous on a busy machine (never flaky)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

TENANTS = 12
RESIDENT = 4
STEPS = 2
EXPIRY_S = 20  # above the SDK's 10 s heartbeat period, so live sessions never expire


KEYS = """
[[key]]
name = "paged"
key = "tml-paged"

[[key]]
name = "silent"
key = "tml-silent"

[[key]]
name = "alice"
key = "tml-alice"
max_training_runs = 1
"""


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    return path


@pytest.fixture(scope="module")
def paged(
    tmp_path_factory: pytest.TempPathFactory, keys_file: Path
) -> Iterator[tuple[Server, int]]:
    port = free_port()
    srv = start_server(
        tmp_path_factory.mktemp("paged") / "data",
        "--keys-file",
        str(keys_file),
        "--max-resident-models",
        str(RESIDENT),
        "--session-expiry",
        str(EXPIRY_S),
        "--metrics-port",
        str(port),
    )
    yield srv, port
    assert stop_server(srv) == 0, srv.log()[-3000:]


def _train_all(server: Server, base_model: str, key: str) -> list[Path]:
    """12 tenants, all steps submitted before any result is awaited; each saves its state."""
    client = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    trainers = [
        client.create_lora_training_client(base_model=base_model, rank=4, seed=100 + i).result()
        for i in range(TENANTS)
    ]
    data = quickstart_data(trainers[0].get_tokenizer())
    pending: list[Any] = []
    for step in range(STEPS):
        for i, t in enumerate(trainers):
            batch = [data[(i + step + k) % len(data)] for k in range(2)]
            pending.append(t.forward_backward(batch, "cross_entropy"))
            pending.append(t.optim_step(types.AdamParams(learning_rate=1e-2)))
    saves = [t.save_state("final") for t in trainers]
    for f in pending:
        f.result()
    paths = [s.result().path for s in saves]
    client.close("success").result()
    return [server.data_dir / "checkpoints" / p.removeprefix("tinker://") for p in paths]


def _adapter(directory: Path) -> dict[str, np.ndarray]:
    files = sorted(directory.rglob("adapter_model.safetensors"))
    assert files, f"no adapter under {directory}"
    return load_file(files[0])


def test_twelve_tenants_through_four_slots_match_an_unpaged_run(
    paged: tuple[Server, int], server: Server, base_model: str
) -> None:
    paged_server, metrics_port = paged
    got = _train_all(paged_server, base_model, "tml-paged")
    want = _train_all(server, base_model, "tml-unpaged-reference")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        a, b = _adapter(g), _adapter(w)
        assert a.keys() == b.keys()
        worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
        assert worst <= 1e-5, f"tenant {i}: adapters differ by {worst}"
    families = scrape(f"http://127.0.0.1:{metrics_port}/metrics")
    pages = {
        s.labels["direction"]: s.value for s in samples(families, "lockstep_model_pages_total")
    }
    assert pages.get("out", 0) > 0 and pages.get("in", 0) > 0, pages
    assert samples(families, "lockstep_model_page_in_duration_seconds_count")[0].value > 0
    assert "Traceback" not in paged_server.log()


def test_a_silent_session_ends_and_its_models_are_freed(
    paged: tuple[Server, int], base_model: str
) -> None:
    srv, _ = paged
    with httpx.Client(
        base_url=srv.base_url, headers={"X-API-Key": "tml-silent"}, timeout=60
    ) as http:
        session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "t"})
        session_id = session.json()["session_id"]
        created = http.post(
            "/api/v1/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 0,
                "base_model": base_model,
                "lora_config": {"rank": 4},
            },
        ).json()
        for _ in range(100):
            answer = http.post(
                "/api/v1/retrieve_future", json={"request_id": created["request_id"]}
            ).json()
            if answer.get("type") != "try_again":
                break
        model_id = answer["model_id"]
        deadline = time.monotonic() + EXPIRY_S * 4
        while time.monotonic() < deadline and f"model {model_id} freed" not in srv.log():
            time.sleep(1)
        assert f"model {model_id} freed" in srv.log()
        beat = http.post("/api/v1/session_heartbeat", json={"session_id": session_id})
        assert beat.status_code == 410
        refused = http.post(
            "/api/v1/optim_step",
            json={"model_id": model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.1}},
        )
        assert refused.status_code == 400 and "has ended" in refused.json()["detail"]


def _wait_for(predicate: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(what)


def test_keys_file_names_quotas_and_reload_on_sighup(
    paged: tuple[Server, int], keys_file: Path, base_model: str
) -> None:
    srv, _ = paged
    unknown = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-not-listed")
    with pytest.raises(tinker.AuthenticationError):
        unknown.create_lora_training_client(base_model=base_model, rank=4).result()

    alice = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-alice")
    alice.create_lora_training_client(base_model=base_model, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="max_training_runs: 1"):  # her quota
        alice.create_lora_training_client(base_model=base_model, rank=4).result()

    # add bob and revoke alice, then SIGHUP `lockstep serve`: no restart
    keys_file.write_text(
        KEYS.replace("max_training_runs = 1", "max_training_runs = 1\nrevoked = true")
        + '\n[[key]]\nname = "bob"\nkey = "tml-bob"\n'
    )
    srv.proc.send_signal(signal.SIGHUP)
    headers = {"X-API-Key": "tml-alice"}

    def revoked() -> bool:
        r = httpx.get(srv.base_url + "/api/v1/sessions", headers=headers, timeout=10)
        return r.status_code == 401 and "revoked" in r.text

    _wait_for(revoked, "alice still works after SIGHUP")
    bob = httpx.get(srv.base_url + "/api/v1/sessions", headers={"X-API-Key": "tml-bob"})
    assert bob.status_code == 200, bob.text


def test_admin_cli_reports_per_key(paged: tuple[Server, int], keys_file: Path) -> None:
    srv, _ = paged
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lockstep.cli",
            "admin",
            "--data-dir",
            str(srv.data_dir),
            "--keys-file",
            str(keys_file),
            "--json",
            "usage",
            "--since",
            "2h",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = {r["name"]: r for r in json.loads(out.stdout)}
    assert rows["paged"]["tokens_trained"] > 0 and rows["paged"]["steps"] == TENANTS * STEPS
    assert rows["paged"]["checkpoints"] == TENANTS
    audit = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "admin", "--data-dir", str(srv.data_dir)]
        + ["--json", "audit", "--owner", owner_of("tml-silent")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    events = [r["event"] for r in json.loads(audit.stdout)]
    assert events[0] == "session_created" and "session_expired" in events
    keys = subprocess.run(
        [sys.executable, "-m", "lockstep.cli", "admin", "--data-dir", str(srv.data_dir), "keys"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert owner_of("tml-paged") in keys.stdout
