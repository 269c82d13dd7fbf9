"""Runs, checkpoints, capabilities, and signed checkpoint-file URLs (stand-in scheduler)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from tinker import types

from lockstep.gateway.deps import owner_of
from lockstep.gateway.errors import ApiError
from lockstep.gateway.signing import (
    FileRef,
    check_relative_path,
    resolve_inside,
    sign,
    signed_url,
    verify,
)
from lockstep.v1 import scheduler_pb2 as pb
from tests.scheduler_standin import (
    TEST_API_KEY,
    StandInScheduler,
    gateway_client,
)

OWNER = owner_of(TEST_API_KEY)
RUN = "sess-1:train:0"
T0 = datetime(2026, 11, 20, 21, 0, tzinfo=UTC).timestamp()
CKPT = pb.Checkpoint(
    checkpoint_id="weights/ckpt-1",
    checkpoint_type="training",
    time=T0,
    tinker_path=f"tinker://{RUN}/weights/ckpt-1",
    size_bytes=1234,
)


@pytest.fixture
def api(standin: tuple[StandInScheduler, str], sched: StandInScheduler) -> Iterator[Any]:
    with gateway_client(standin[1]) as client:
        yield client


def test_capabilities(api: Any, sched: StandInScheduler) -> None:
    sched.replies["GetServerCapabilities"] = pb.ServerCapabilities(
        models=[
            pb.SupportedModel(
                model_name="Qwen/Qwen3-0.6B",
                max_context_length=4096,
                max_tokens_per_datum=3000,
                trainer_memory_budget_bytes=1 << 30,
                custom_loss_max_flops_per_token=1 << 16,
                custom_loss_max_memory_bytes=1 << 24,
                trainer_path="generic",
                trainer_kernels={"gated_delta_rule": "fla", "short_convolution": "reference"},
                sampler_kernels={"gated_delta_rule": "reference"},
            )
        ],
        engines=pb.EngineCapabilities(sampler_inputs=["image", "text"]),
        version="0.9.1",
        state_format=7,
    )
    assert api.get("/api/v1/get_server_capabilities").json() == {
        "supported_models": [
            {
                "model_name": "Qwen/Qwen3-0.6B",
                "max_context_length": 4096,
                "trainable": True,
                "sampleable": True,
                "max_tokens_per_datum": 3000,
                "trainer_memory_budget_bytes": 1 << 30,
                "custom_loss_max_flops_per_token": 1 << 16,
                "custom_loss_max_memory_bytes": 1 << 24,
                "trainer_path": "generic",
                "sampler_inputs": ["image", "text"],
                "trainer_kernels": {"gated_delta_rule": "fla", "short_convolution": "reference"},
                "sampler_kernels": {"gated_delta_rule": "reference"},
            }
        ],
        "lockstep_version": "0.9.1",
        "state_format": 7,
    }


def test_training_runs_validate_as_sdk_types(api: Any, sched: StandInScheduler) -> None:
    run = pb.TrainingRun(
        training_run_id=RUN,
        base_model="Qwen/Qwen3-0.6B",
        model_owner=OWNER,
        is_lora=True,
        lora_rank=8,
        last_request_time=T0,
        last_checkpoint=CKPT,
        user_metadata={"a": "b"},
    )
    sched.replies["ListTrainingRuns"] = pb.TrainingRunList(runs=[run], total_count=41)
    r = api.get(
        "/api/v1/training_runs", params={"limit": 20, "offset": 20, "access_scope": "owned"}
    )
    listing = types.TrainingRunsResponse.model_validate(r.json())
    assert (listing.cursor.offset, listing.cursor.limit, listing.cursor.total_count) == (20, 20, 41)
    assert r.json()["training_runs"][0]["last_request_time"] == "2026-11-20T21:00:00Z"
    assert sched.last("ListTrainingRuns") == pb.ListRequest(owner=OWNER, limit=20, offset=20)

    sched.replies["GetTrainingRun"] = run
    got = types.TrainingRun.model_validate(api.get(f"/api/v1/training_runs/{RUN}").json())
    assert got.last_checkpoint is not None and got.last_checkpoint.size_bytes == 1234
    assert got.last_request_time.tzinfo is not None and got.last_sampler_checkpoint is None
    assert sched.last("GetTrainingRun") == pb.RunRef(owner=OWNER, run_id=RUN)


def test_checkpoint_listings(api: Any, sched: StandInScheduler) -> None:
    expiring = pb.Checkpoint()
    expiring.CopyFrom(CKPT)
    expiring.expires_at = T0 + 3600
    sched.replies["ListCheckpoints"] = pb.CheckpointList(checkpoints=[expiring], total_count=1)
    body = api.get(f"/api/v1/training_runs/{RUN}/checkpoints").json()
    parsed = types.CheckpointsListResponse.model_validate(body)
    assert parsed.checkpoints[0].tinker_path == CKPT.tinker_path
    assert body["checkpoints"][0]["expires_at"] == "2026-11-20T22:00:00Z"
    assert sched.last("ListCheckpoints").run_id == RUN

    api.get("/api/v1/checkpoints", params={"limit": 1000, "offset": 0})
    req = sched.last("ListCheckpoints")
    assert (req.HasField("run_id"), req.limit, req.owner) == (False, 1000, OWNER)


def test_checkpoint_mutations(api: Any, sched: StandInScheduler) -> None:
    base = f"/api/v1/training_runs/{RUN}/checkpoints/weights/ckpt-1"
    ref = pb.CheckpointRef(owner=OWNER, tinker_path=f"tinker://{RUN}/weights/ckpt-1")
    assert api.delete(base).status_code == 200
    assert sched.last("DeleteCheckpoint") == ref
    assert api.post(f"{base}/publish").status_code == 200
    assert sched.last("SetCheckpointPublic") == pb.SetCheckpointPublicRequest(ref=ref, public=True)
    assert api.delete(f"{base}/publish").status_code == 200
    assert not sched.last("SetCheckpointPublic").public
    assert api.put(f"{base}/ttl", json={"ttl_seconds": 3600}).status_code == 200
    assert sched.last("SetCheckpointTtl").ttl_seconds == 3600
    api.put(f"{base}/ttl", json={"ttl_seconds": None})
    assert not sched.last("SetCheckpointTtl").HasField("ttl_seconds")
    bad = api.delete(f"/api/v1/training_runs/{RUN}/checkpoints/blobs/x")
    assert bad.status_code == 404


def test_weights_info(api: Any, sched: StandInScheduler) -> None:
    sched.replies["GetWeightsInfo"] = pb.WeightsInfo(
        base_model="B", is_lora=True, lora_config=pb.LoraConfig(rank=4, train_mlp=True)
    )
    r = api.post("/api/v1/weights_info", json={"tinker_path": CKPT.tinker_path})
    info = types.WeightsInfoResponse.model_validate(r.json())
    assert (info.base_model, info.lora_rank, info.train_mlp, info.train_attn) == (
        "B",
        4,
        True,
        False,
    )
    bad = api.post("/api/v1/weights_info", json={"tinker_path": "tinker://x/weights"})
    assert bad.status_code == 400 and bad.json()["detail"].startswith("tinker_path:")


# ---------------------------------------------------------------- signed file URLs
@pytest.fixture
def checkpoint_dir(tmp_path: Path, sched: StandInScheduler) -> Path:
    root = tmp_path / "ckpt"
    (root / "sub").mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 8}')
    (root / "sub" / "adapter_model.safetensors").write_bytes(b"\1\2\3" * 1000)
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", root / "escape.txt")
    sched.replies["GetCheckpointFiles"] = pb.CheckpointFiles(
        directory=str(root),
        relative_paths=["adapter_config.json", "sub/adapter_model.safetensors", "escape.txt"],
        expires=time.time() + 7200,
    )
    return root


def test_external_weights_urls_download(api: Any, checkpoint_dir: Path) -> None:
    r = api.get(
        f"/api/v1/training_runs/{RUN}/checkpoints/external_weights/exp1/external_weights_urls"
    )
    parsed = types.ExternalWeightsUrlsResponse.model_validate(r.json())
    assert parsed.expires.tzinfo is not None
    assert parsed.expires > datetime.now(parsed.expires.tzinfo)
    assert set(parsed.urls) == {
        "adapter_config.json",
        "sub/adapter_model.safetensors",
        "escape.txt",
    }
    anonymous = {"X-API-Key": ""}
    got = api.get(parsed.urls["sub/adapter_model.safetensors"], headers=anonymous)
    assert got.status_code == 200 and got.content == b"\1\2\3" * 1000
    assert api.get(parsed.urls["adapter_config.json"], headers=anonymous).json() == {"r": 8}
    # A listed symlink that points outside the checkpoint directory is refused.
    assert api.get(parsed.urls["escape.txt"], headers=anonymous).status_code == 404

    url = urlsplit(parsed.urls["adapter_config.json"])
    query = parse_qs(url.query)
    tampered = api.get(url.path.replace("adapter_config", "adapter_model"), params=query)
    assert tampered.status_code == 403
    expired = api.get(url.path, params={"expires": "1", "sig": query["sig"][0]})
    assert expired.status_code == 403
    traversal = api.get(
        url.path.replace("adapter_config.json", "..%2F..%2Fsecret.txt"), params=query
    )
    assert traversal.status_code in (400, 403, 404)


def test_signed_file_must_be_listed(
    api: Any, sched: StandInScheduler, checkpoint_dir: Path
) -> None:
    ref = FileRef(OWNER, RUN, "external_weights", "exp1", "unlisted.bin", int(time.time()) + 60)
    (checkpoint_dir / "unlisted.bin").write_bytes(b"x")
    url = signed_url("http://testserver", ref, b"gateway-test-secret")
    assert api.get(url).status_code == 404
    assert sched.last("GetCheckpointFiles").owner == OWNER


def test_signature_rules() -> None:
    secret = b"k"
    ref = FileRef("o", RUN, "external_weights", "n", "a/b.json", 2_000_000_000)
    sig = sign(ref, secret)
    verify(ref, sig, secret, now=1_999_999_999)
    for bad_ref, bad_secret, now in [
        (FileRef("p", RUN, "external_weights", "n", "a/b.json", 2_000_000_000), secret, 0),
        (FileRef("o", RUN, "external_weights", "n", "a/c.json", 2_000_000_000), secret, 0),
        (FileRef("o", RUN, "external_weights", "n", "a/b.json", 2_000_000_001), secret, 0),
        (ref, b"other", 0),
        (ref, secret, 2_000_000_001),
    ]:
        with pytest.raises(ApiError) as err:
            verify(bad_ref, sig, bad_secret, now=now)
        assert err.value.status_code == 403


@pytest.mark.parametrize(
    "path", ["../x", "a/../../x", "/etc/passwd", "a//b", "./a", "a\\..\\b", "", "a/\0"]
)
def test_relative_path_rejects_traversal(path: str) -> None:
    with pytest.raises(ApiError):
        check_relative_path(path)


def test_resolve_inside(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path, tmp_path / "d" / "up")
    assert resolve_inside(str(tmp_path / "d"), "f.txt") == (tmp_path / "d" / "f.txt").resolve()
    with pytest.raises(ApiError):
        resolve_inside(str(tmp_path / "d"), "up/secret")


def test_validly_signed_traversal_is_still_refused(
    api: Any, sched: StandInScheduler, checkpoint_dir: Path
) -> None:
    """Defense in depth: even a listed, correctly signed `..` path never leaves the directory."""
    files = sched.replies["GetCheckpointFiles"]
    assert isinstance(files, pb.CheckpointFiles)
    files.relative_paths.append("../secret.txt")
    ref = FileRef(OWNER, RUN, "external_weights", "exp1", "../secret.txt", int(time.time()) + 60)
    url = signed_url("http://testserver", ref, b"gateway-test-secret")
    # Percent-encoded dots survive client-side URL normalization and reach the route as "..".
    r = api.get(url.replace("/../", "/%2E%2E/"))
    assert r.status_code == 400 and "outside" not in r.text
    listing = api.get(
        f"/api/v1/training_runs/{RUN}/checkpoints/external_weights/exp1/external_weights_urls"
    )
    assert "../secret.txt" not in listing.json()["urls"]
