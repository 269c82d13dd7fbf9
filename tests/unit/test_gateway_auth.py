"""API-key rules: fixed key list, any `tml-` key, missing keys, and unauthenticated routes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from lockstep.gateway.app import create_app
from lockstep.gateway.deps import authenticate, owner_of
from lockstep.gateway.errors import ApiError
from lockstep.gateway.settings import GatewaySettings
from tests.scheduler_standin import StandInScheduler, gateway_client, running_standin


def _conn(**kw: Any) -> Request:
    """A request to a gateway with these settings, for `authenticate`."""
    app = create_app(GatewaySettings(scheduler_address="127.0.0.1:1", **kw))
    return Request({"type": "http", "app": app, "headers": []})


def test_owner_is_a_short_sha256_of_the_key() -> None:
    assert owner_of("tml-abc") == hashlib.sha256(b"tml-abc").hexdigest()[:16]
    assert owner_of("tml-abc") != owner_of("tml-abd")


def test_fixed_key_list() -> None:
    s = _conn(api_keys=frozenset({"tml-one", "sk-two"}), allow_any_tml_key=True)
    assert authenticate(s, "tml-one").owner == owner_of("tml-one")
    assert authenticate(s, "sk-two").owner == owner_of("sk-two")
    for bad in ("tml-three", "tml-on", ""):
        with pytest.raises(ApiError) as err:
            authenticate(s, bad)
        assert err.value.status_code == 401  # a key list wins over allow_any_tml_key


def test_any_tml_key() -> None:
    s = _conn(allow_any_tml_key=True)
    assert authenticate(s, "tml-whatever").owner == owner_of("tml-whatever")
    with pytest.raises(ApiError):
        authenticate(s, "sk-whatever")


def test_no_keys_configured_rejects_everything() -> None:
    with pytest.raises(ApiError) as err:
        authenticate(_conn(), "tml-x")
    assert err.value.status_code == 401


def test_missing_key() -> None:
    with pytest.raises(ApiError) as err:
        authenticate(_conn(allow_any_tml_key=True), None)
    assert "X-API-Key" in err.value.detail


@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[StandInScheduler, str]]:
    with running_standin() as running:
        yield running


@pytest.mark.parametrize(
    "method, path",
    [
        ("post", "/api/v1/client/config"),
        ("post", "/api/v1/create_session"),
        ("post", "/api/v1/retrieve_future"),
        ("post", "/api/v1/forward_backward"),
        ("get", "/api/v1/training_runs"),
        ("get", "/api/v1/get_server_capabilities"),
        ("get", "/api/v1/auth/apikey/me"),
    ],
)
def test_routes_need_a_key(standin: tuple[StandInScheduler, str], method: str, path: str) -> None:
    with gateway_client(standin[1]) as client:
        for headers in ({"X-API-Key": ""}, {"X-API-Key": "tml-wrong"}):
            r = getattr(client, method)(path, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.json()["detail"]


def test_key_checked_before_the_body(standin: tuple[StandInScheduler, str]) -> None:
    with gateway_client(standin[1]) as client:
        r = client.post("/api/v1/optim_step", content=b"{bad", headers={"X-API-Key": "tml-no"})
    assert r.status_code == 401


def test_unauthenticated_routes(standin: tuple[StandInScheduler, str]) -> None:
    with gateway_client(standin[1]) as client:
        client.headers.pop("X-API-Key")
        assert client.get("/healthz").status_code == 200
        assert client.get("/api/v1/healthz").status_code == 200
        # Signed-URL route: no key needed, but a signature is (403 without a valid one).
        r = client.get(
            "/api/v1/checkpoint_files/o/run/external_weights/n/f.json",
            params={"expires": 9999999999, "sig": "00"},
        )
        assert r.status_code == 403


def test_any_tml_key_mode_end_to_end(standin: tuple[StandInScheduler, str]) -> None:
    sched, address = standin
    sched.reset()
    with gateway_client(address, api_keys=frozenset(), allow_any_tml_key=True) as client:
        ok = client.post(
            "/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "tml-q"}
        )
        bad = client.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": "q"})
    assert (ok.status_code, bad.status_code) == (200, 401)
    assert sched.last("CreateSession").owner == owner_of("tml-q")


def test_api_key_me(standin: tuple[StandInScheduler, str]) -> None:
    with gateway_client(standin[1]) as client:
        me = client.get("/api/v1/auth/apikey/me").json()
        revoke = client.delete("/api/v1/auth/apikey/me")
    assert set(me) == {"key_id", "name", "note", "details"}
    assert me["details"]["org_details"]["name"] == "lockstep"
    assert revoke.status_code == 400 and revoke.json()["detail"]


def test_keys_file_key_and_quota_reach_the_scheduler(
    standin: tuple[StandInScheduler, str], tmp_path: Path
) -> None:
    """The keys file's quota rides on create_model; its key also works on the bearer routes."""
    sched, address = standin
    sched.reset()
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "q"\nkey = "tml-q"\nmax_training_runs = 3\n')
    with gateway_client(address, api_keys=frozenset(), keys_file=keys) as client:
        client.headers["X-API-Key"] = "tml-q"
        created = client.post(
            "/api/v1/create_model",
            json={"session_id": "sess-1", "model_seq_id": 0, "base_model": "b"},
        )
        models = client.get("/oai/api/v1/models", headers={"Authorization": "Bearer tml-q"})
    assert (created.status_code, models.status_code) == (200, 200)
    submitted = sched.last("Submit")
    assert (submitted.owner, submitted.key_max_training_runs) == (owner_of("tml-q"), 3)
