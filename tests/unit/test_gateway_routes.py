"""Gateway routes -> the one gRPC call each makes, against a stand-in scheduler (canned replies).

Bootstrap, health, sessions and training submissions. Sampling, futures, runs and files
have their own files.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest
import zstandard

from lockstep.gateway.deps import owner_of
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.version import VERSION
from lockstep.wire.v1 import tinker_pb2
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
)

OWNER = owner_of(TEST_API_KEY)
MODEL = "sess-1:train:0"


@pytest.fixture
def api(standin: tuple[StandInScheduler, str], sched: StandInScheduler) -> Iterator[Any]:
    with gateway_client(standin[1]) as client:
        yield client


# ---------------------------------------------------------------- bootstrap and health
def test_client_config_and_friends(api: Any, sched: StandInScheduler) -> None:
    sched.replies["GetServerCapabilities"] = pb.ServerCapabilities(
        engines=pb.EngineCapabilities(trainer="local", custom_loss=True)
    )
    config = api.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert config.json() == {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": False,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": 1024,  # the SDK chunks below the server's limits
        "fwdbwd_max_chunk_bytes_count": 5_000_000,
        "custom_loss_server_side": True,  # create_custom_loss uploads; losses run here
        "sample_use_retrieve_futures": True,  # one session poller instead of one per sample
        "sample_join_sampling_session": True,  # unpickled clients ask for their clone id
    }
    # A training engine that runs no server-side custom losses (Megatron): the SDK runs them.
    sched.replies["GetServerCapabilities"] = pb.ServerCapabilities(
        engines=pb.EngineCapabilities(trainer="megatron", custom_loss=False)
    )
    config = api.post("/api/v1/client/config", json={"sdk_version": "0.38.0"})
    assert config.json()["custom_loss_server_side"] is False
    dynamic = api.post("/api/v1/client/dynamic_config", json={})
    assert dynamic.json() == {"refresh_interval_sec": 300, "sample_cancel_enabled": True}
    telemetry = api.post("/api/v1/telemetry", json={"events": [], "session_id": "s"})
    assert telemetry.json() == {"status": "accepted"}


def test_healthz_follows_the_scheduler(api: Any, sched: StandInScheduler) -> None:
    ok = api.get("/healthz", headers={"X-API-Key": ""})
    assert (ok.status_code, ok.json()["status"]) == (200, "ok")
    assert ok.json()["version"] == VERSION  # the gateway's own, whatever the scheduler runs
    sched.replies["Health"] = pb.HealthReply(
        ready=False, parts={"engine": "loading weights"}, version="0.9.1", state_format=7
    )
    down = api.get("/api/v1/healthz")
    assert down.status_code == 503
    assert down.json() == {
        "status": "unavailable",
        "parts": {"engine": "loading weights"},
        "version": VERSION,
        "scheduler_version": "0.9.1",
        "state_format": 7,
    }


def test_healthz_when_the_scheduler_is_unreachable() -> None:
    with gateway_client("127.0.0.1:1") as client:
        r = client.get("/healthz")
    assert r.status_code == 503
    assert r.json()["parts"]["scheduler"].startswith("unreachable (UNAVAILABLE)")
    assert r.json()["version"] == VERSION


# ---------------------------------------------------------------- sessions
def test_create_session(api: Any, sched: StandInScheduler) -> None:
    body = {
        "tags": ["a"],
        "user_metadata": {"k": "v", "n": 3},
        "sdk_version": "0.38.0",
        "project_id": "p1",
        "type": "create_session",
        "unknown_field": 1,
    }
    r = api.post("/api/v1/create_session", json=body)
    assert r.json() == {"type": "create_session", "session_id": "sess-1"}
    req = sched.last("CreateSession")
    assert (req.owner, list(req.tags), req.sdk_version, req.project_id) == (
        OWNER,
        ["a"],
        "0.38.0",
        "p1",
    )
    assert dict(req.user_metadata) == {"k": "v", "n": "3"}
    assert not req.HasField("display_name")


def test_heartbeat_and_finish(api: Any, sched: StandInScheduler) -> None:
    beat = {"session_id": "sess-1", "type": "session_heartbeat"}
    assert api.post("/api/v1/session_heartbeat", json=beat).json() == {"type": "session_heartbeat"}
    sched.replies["Heartbeat"] = pb.HeartbeatReply(finished=True)
    gone = api.post("/api/v1/session_heartbeat", json=beat)
    assert gone.status_code == 410 and "finished" in gone.json()["detail"]

    finish = {"reason": {"type": "success"}, "detail": None}
    assert api.post("/api/v1/sessions/sess-1/finish", json=finish).status_code == 200
    assert api.post("/api/v1/sessions/sess-1/finish").status_code == 200
    assert sched.last("FinishSession") == pb.SessionRef(owner=OWNER, session_id="sess-1")


def test_list_and_get_sessions(api: Any, sched: StandInScheduler) -> None:
    sched.replies["ListSessions"] = pb.SessionList(session_ids=["sess-1", "sess-2"], total_count=2)
    r = api.get("/api/v1/sessions", params={"limit": 5, "offset": 1, "access_scope": "owned"})
    assert r.json() == {"sessions": ["sess-1", "sess-2"]}
    assert sched.last("ListSessions") == pb.ListRequest(owner=OWNER, limit=5, offset=1)
    sched.replies["GetSession"] = pb.SessionInfo(
        training_run_ids=[MODEL], sampler_ids=["s:sample:0"]
    )
    got = api.get("/api/v1/sessions/sess-1").json()
    assert got["training_run_ids"] == [MODEL] and got["sampler_ids"] == ["s:sample:0"]
    assert api.get("/api/v1/sessions", params={"limit": 0}).status_code == 400


# ---------------------------------------------------------------- training
def test_create_model_and_get_info(api: Any, sched: StandInScheduler) -> None:
    sched.replies["Submit"] = pb.SubmitReply(request_id="req-7", model_id=MODEL)
    body = {
        "session_id": "sess-1",
        "model_seq_id": 0,
        "base_model": "Qwen/Qwen3-0.6B",
        "lora_config": {"rank": 8, "train_unembed": True, "train_mlp": True, "train_attn": False},
        "optimizer_config": {"type": "adamw"},
        "type": "create_model",
    }
    r = api.post("/api/v1/create_model", json=body)
    assert r.json() == {"request_id": "req-7", "model_id": MODEL}
    op = sched.last("Submit").create_model
    assert (op.session_id, op.model_seq_id, op.base_model, op.optimizer_type) == (
        "sess-1",
        0,
        "Qwen/Qwen3-0.6B",
        "adamw",
    )
    assert (op.lora_config.rank, op.lora_config.train_attn) == (8, False)
    assert not op.lora_config.HasField("seed")

    sched.replies["GetModelInfo"] = pb.ModelInfo(
        model_id=MODEL,
        base_model="Qwen/Qwen3-0.6B",
        arch="qwen3",
        lora_rank=8,
        trainer_kernels={"mamba2_scan": "fla"},
    )
    info = api.post("/api/v1/get_info", json={"model_id": MODEL, "type": "get_info"}).json()
    assert info["model_data"] == {
        "arch": "qwen3",
        "model_name": "Qwen/Qwen3-0.6B",
        "tokenizer_id": None,
    }
    assert (info["type"], info["is_lora"], info["lora_rank"]) == ("get_info", True, 8)
    assert info["optimizer_config"] == {"type": "adamw"}
    assert info["trainer_kernels"] == {"mamba2_scan": "fla"}


# The gateway checks the address; what the request carries is the scheduler's to judge
# (tests/unit/test_request_rules.py names each of those rules once).
@pytest.mark.parametrize(
    "change, detail",
    [
        ({"session_id": "bad id"}, "session_id: 'bad id' is not a valid id"),
        ({"model_seq_id": 2**31}, "model_seq_id: must be <= 2147483647"),
    ],
)
def test_create_model_rejects(api: Any, change: dict[str, Any], detail: str) -> None:
    body = {"session_id": "sess-1", "model_seq_id": 0, "base_model": "m", **change}
    r = api.post("/api/v1/create_model", json=body)
    assert r.status_code == 400 and r.json()["detail"].startswith(detail)


def _fwd_bwd(seq_id: int = 1) -> bytes:
    req = tinker_pb2.ForwardBackwardRequest(model_id=MODEL, seq_id=seq_id, loss_fn="cross_entropy")
    datum = req.data.add()
    datum.model_input.add().encoded_text.tokens = (10).to_bytes(4, "little") * 3
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        tinker_pb2.Tensor(dtype=tinker_pb2.DTYPE_INT64, shape=[3], dense=b"\1" + b"\0" * 23)
    )
    return req.SerializeToString()


@pytest.mark.parametrize("zstd", [False, True])
def test_forward_backward_protobuf(api: Any, sched: StandInScheduler, zstd: bool) -> None:
    body = _fwd_bwd()
    headers = {"Content-Type": "application/x-protobuf"}
    if zstd:
        body, headers["Content-Encoding"] = zstandard.ZstdCompressor().compress(body), "zstd"
    sched.replies["Submit"] = pb.SubmitReply(request_id="req-fb", model_id=MODEL)
    r = api.post("/api/v1/forward_backward", content=body, headers=headers)
    assert r.json() == {"request_id": "req-fb", "model_id": MODEL}
    submitted = sched.last("Submit")
    assert submitted.owner == OWNER
    assert submitted.forward_backward.SerializeToString() == _fwd_bwd()


def test_forward_backward_rejections(api: Any) -> None:
    headers = {"Content-Type": "application/x-protobuf"}
    bad = api.post("/api/v1/forward_backward", content=b"\x0a\xff", headers=headers)
    assert bad.json() == {"detail": "body: not a valid ForwardBackwardRequest"}
    zero = api.post("/api/v1/forward_backward", content=_fwd_bwd(seq_id=0), headers=headers)
    assert (zero.status_code, zero.json()) == (400, {"detail": "seq_id: must be >= 1"})


# A forward_backward as the SDK sends it in JSON.
FB_JSON: dict[str, Any] = {
    "model_id": MODEL,
    "seq_id": 2,
    "forward_input": {
        "data": [
            {
                "model_input": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                "loss_fn_inputs": {"target_tokens": {"data": [2, 3], "dtype": "int64"}},
            }
        ],
        "loss_fn": "cross_entropy",
    },
}


def test_forward_backward_json_body(api: Any, sched: StandInScheduler) -> None:
    body = copy.deepcopy(FB_JSON)
    assert api.post("/api/v1/forward_backward", json=body).status_code == 200
    fb = sched.last("Submit").forward_backward
    assert (fb.seq_id, fb.forward_only, len(fb.data)) == (2, True, 1)
    body["forward_input"]["data"][0]["model_input"]["chunks"][0]["tokens"] = [2**40]
    r = api.post("/api/v1/forward_backward", json=body)
    assert r.json()["detail"] == "data[0].model_input.chunks[0].tokens: token ids must fit int32"


@pytest.mark.parametrize("field", ["adam_params", "optimizer_params", "optim_params"])
def test_optim_step_param_aliases(api: Any, sched: StandInScheduler, field: str) -> None:
    params: dict[str, Any] = {
        "learning_rate": 0.001,
        "beta1": 0.8,
        "beta2": 0.9,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "grad_clip_norm": 1.0,
    }
    if field != "adam_params":
        params["type"] = "adamw"
    body = {"model_id": MODEL, "seq_id": 4, "type": "optim_step", field: params}
    assert api.post("/api/v1/optim_step", json=body).status_code == 200
    op = sched.last("Submit").optim_step
    assert (op.model_id, op.seq_id) == (MODEL, 4)
    assert op.adam == pb.AdamParams(
        learning_rate=0.001, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0
    )


@pytest.mark.parametrize(
    "body, detail",
    [
        (
            {"seq_id": 1, "optimizer_params": {"type": "dimuon", "learning_rate": 0.01}},
            "optimizer_params.type: optimizer 'dimuon' is not supported",
        ),
        ({"seq_id": 0, "adam_params": {}}, "seq_id: must be >= 1"),
        ({"adam_params": {}}, "seq_id: field required"),
    ],
)
def test_optim_step_rejects(api: Any, body: dict[str, Any], detail: str) -> None:
    r = api.post("/api/v1/optim_step", json={"model_id": MODEL, **body})
    assert r.status_code == 400 and r.json()["detail"].startswith(detail)


def test_optim_step_numbers_reach_the_scheduler_as_sent(api: Any, sched: StandInScheduler) -> None:
    """Even a NaN: its rule is the scheduler's (scheduler/ops/optim_step.py)."""
    raw = b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": NaN, "beta1": 1.5}}'
    r = api.post("/api/v1/optim_step", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.json()
    adam = sched.last("Submit").optim_step.adam
    assert math.isnan(adam.learning_rate) and adam.beta1 == 1.5


def test_save_weights_forms(api: Any, sched: StandInScheduler) -> None:
    base = {"model_id": MODEL, "seq_id": 3}
    api.post(
        "/api/v1/save_weights",
        json={
            **base,
            "path": "ckpt-1",
            "ttl_seconds": 7200,
            "overwrite": True,
            "user_metadata": {"a": "b"},
        },
    )
    save = sched.last("Submit").save_weights
    assert (save.kind, save.name, save.ttl_seconds, save.overwrite) == (
        pb.CHECKPOINT_KIND_TRAINING,
        "ckpt-1",
        7200,
        True,
    )
    assert dict(save.user_metadata) == {"a": "b"}

    api.post(
        "/api/v1/save_weights_for_sampler", json={**base, "path": "step-0", "kind": "snapshot"}
    )
    named = sched.last("Submit").save_weights
    assert (named.kind, named.name, named.HasField("sampling_session_seq_id")) == (
        pb.CHECKPOINT_KIND_SAMPLER,
        "step-0",
        False,
    )

    api.post("/api/v1/save_weights_for_sampler", json={**base, "sampling_session_seq_id": 2})
    unnamed = sched.last("Submit").save_weights
    assert (unnamed.HasField("name"), unnamed.sampling_session_seq_id) == (False, 2)

    api.post("/api/v1/save_weights_external", json={**base, "path": "exp1", "ttl_seconds": 3600})
    ext = sched.last("Submit").save_weights
    assert (ext.kind, ext.name) == (pb.CHECKPOINT_KIND_EXTERNAL, "exp1")
    api.post(
        "/api/v1/save_weights_external",
        json={**base, "path": "exp2", "age_encryption_recipients": ["age1abc"]},
    )
    # recipients are parsed (and refused with a 400) by the scheduler, which encrypts
    assert list(sched.last("Submit").save_weights.age_recipients) == ["age1abc"]


@pytest.mark.parametrize(
    "route, body, detail",
    [
        ("save_weights", {"model_id": "a/b", "path": "x"}, "model_id: 'a/b' is not a valid id"),
        ("save_weights_for_sampler", {"path": "x", "kind": "live"}, "kind: must be"),
    ],
)
def test_save_rejects(api: Any, route: str, body: dict[str, Any], detail: str) -> None:
    r = api.post(f"/api/v1/{route}", json={"model_id": MODEL, "seq_id": 1, **body})
    assert r.status_code == 400 and r.json()["detail"].startswith(detail)


def test_load_weights_forms(api: Any, sched: StandInScheduler) -> None:
    path = f"tinker://{MODEL}/weights/ckpt-1"
    api.post(
        "/api/v1/load_weights",
        json={"model_id": MODEL, "seq_id": 2, "path": path, "optimizer": True},
    )
    legacy = sched.last("Submit").load_weights
    assert (legacy.model_id, legacy.seq_id, legacy.path, legacy.optimizer) == (MODEL, 2, path, True)
    assert not legacy.HasField("session_id")

    api.post(
        "/api/v1/load_weights",
        json={
            "session_id": "sess-2",
            "model_seq_id": 1,
            "path": path,
            "optimizer": False,
            "user_metadata": {"created_by": "cli"},
        },
    )
    create = sched.last("Submit").load_weights
    assert (create.session_id, create.model_seq_id, create.HasField("model_id")) == (
        "sess-2",
        1,
        False,
    )
    assert dict(create.user_metadata) == {"created_by": "cli"}

    # The path is the scheduler's to judge (it parses it by the same rule, lockstep.paths).
    api.post(
        "/api/v1/load_weights",
        json={"path": "s3://x", "optimizer": False, "model_id": MODEL, "seq_id": 1},
    )
    assert sched.last("Submit").load_weights.path == "s3://x"
    neither = api.post("/api/v1/load_weights", json={"path": path, "optimizer": False})
    assert neither.status_code == 400
