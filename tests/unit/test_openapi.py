"""The gateway's OpenAPI document describes the real endpoints: every path the tinker SDK calls
is in it (or is listed here as not served, with the reason), and the main POST bodies have
schemas with fields."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import tinker

from lockstep.gateway.app import create_app
from lockstep.gateway.settings import GatewaySettings

# SDK paths this server does not serve (the SDK gets a 404), and why.
NOT_SERVED = {
    "/api/v1/auth/token": "JWT exchange; this server uses plain X-API-Key auth",
    "/api/v1/sessions/test-session": "hosted console",
    "/api/v1/sessions/{}/project": "projects are a hosted console feature",
}
MAIN_POSTS = [
    "create_session",
    "session_heartbeat",
    "create_model",
    "get_info",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "save_weights_external",
    "load_weights",
    "create_sampling_session",
    "asample",
    "retrieve_future",
    "weights_info",
]


def sdk_paths() -> set[str]:
    """Every `/api/v1/...` literal in the installed SDK, `{param}`s written as `{}`."""
    found: set[str] = set()
    for source in Path(tinker.__file__).parent.rglob("*.py"):
        for path in re.findall(r'f?"(/api/v1/[^"\s]*)"', source.read_text()):
            found.add(re.sub(r"\{[^}]*\}", "{}", path))
    return found


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    return create_app(GatewaySettings(scheduler_address="127.0.0.1:1")).openapi()


def _matches(template: str, concrete: str) -> bool:
    pattern = re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template))
    return re.fullmatch(pattern, concrete) is not None


def test_every_sdk_path_is_documented(document: dict[str, Any]) -> None:
    paths = sdk_paths()
    assert len(paths) > 30, "the SDK's paths were not found"
    missing = []
    for path in sorted(paths - set(NOT_SERVED)):
        # the SDK's checkpoint_id is "<segment>/<name>", i.e. two path segments here
        concrete = path.replace("checkpoints/{}", "checkpoints/weights/x").replace("{}", "x")
        if not any(_matches(template, concrete) for template in document["paths"]):
            missing.append(path)
    assert not missing, f"the SDK calls paths the OpenAPI document lacks: {missing}"
    stale = set(NOT_SERVED) - paths
    assert not stale, f"NOT_SERVED lists paths the SDK no longer calls: {stale}"


def test_not_served_paths_are_really_absent(document: dict[str, Any]) -> None:
    # literal comparison: /sessions/search is not /sessions/{session_id} (a GET of a session)
    served = {re.sub(r"\{[^}]*\}", "{}", t) for t in document["paths"]}
    assert not served & set(NOT_SERVED), "served now: drop it from NOT_SERVED"


def _resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    if ref is None:
        return schema
    return dict(document["components"]["schemas"][ref.rsplit("/", 1)[-1]])


def test_main_post_bodies_are_described(document: dict[str, Any]) -> None:
    for name in MAIN_POSTS:
        op = document["paths"][f"/api/v1/{name}"]["post"]
        body = op.get("requestBody")
        assert body is not None, f"{name}: no request body in the document"
        schema = _resolve(document, body["content"]["application/json"]["schema"])
        assert schema.get("properties"), f"{name}: bare body schema {schema}"
        for sub in schema["properties"].values():  # nested refs must resolve
            for option in [sub, *sub.get("anyOf", [])]:
                if "$ref" in option:
                    assert _resolve(document, option), (name, option)


def test_forward_backward_documents_the_protobuf_body(document: dict[str, Any]) -> None:
    content = document["paths"]["/api/v1/forward_backward"]["post"]["requestBody"]["content"]
    assert content["application/x-protobuf"]["schema"]["format"] == "binary"
    assert "model_id" in _resolve(document, content["application/json"]["schema"])["required"]
