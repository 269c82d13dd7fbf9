"""Fuzz the HTTP API from its own OpenAPI document (schemathesis): a real `lockstep serve`, valid
and invalid requests generated for every operation it documents, and no answer may be a 5xx."""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from lockstep.gateway.app import create_app
from lockstep.gateway.settings import GatewaySettings

from .conftest import API_KEY, Server

pytestmark = pytest.mark.e2e
# Examples per operation and generation mode: the whole file stays under ~90 s in CI; raise it
# (LOCKSTEP_FUZZ_EXAMPLES=200) for a longer hunt.
EXAMPLES = int(os.environ.get("LOCKSTEP_FUZZ_EXAMPLES", "10"))

# The operations, from the same document the server serves (read here without a server, so
# each one is its own test item). Invalid requests exist only for operations with a body or
# query parameters (path ids are any string; the API key is fixed below).
_DOC = create_app(GatewaySettings(scheduler_address="127.0.0.1:1")).openapi()["paths"]
CASES = [
    (method.upper(), path, mode)
    for path, item in _DOC.items()
    for method, op in item.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode is GenerationMode.POSITIVE
    or "requestBody" in op
    or any(p["in"] == "query" for p in op.get("parameters", []))
]


@pytest.fixture(scope="module")
def api_schema(server: Server) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


@pytest.mark.parametrize(
    ("method", "path", "mode"), CASES, ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES]
)
def test_no_server_errors(
    api_schema: schemathesis.BaseSchema, method: str, path: str, mode: GenerationMode
) -> None:
    operation = api_schema[path][method]
    # A valid key, so the generated requests reach the real handlers (auth has its own tests).
    strategy = operation.as_strategy(generation_mode=mode, headers={"X-API-Key": API_KEY})

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=[not_a_server_error], timeout=60)

    fuzz()
