"""Training runs, checkpoints, weights info and server capabilities (RestClient and CLI)."""

from __future__ import annotations

import logging
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request

from lockstep.gateway.deps import (
    CALL_TIMEOUT_S,
    FileUrlSecret,
    Limit,
    Offset,
    Owner,
    Reader,
    Scheduler,
    Scope,
    Settings,
)
from lockstep.gateway.errors import ApiError, bad_request
from lockstep.gateway.schema import requests as rq
from lockstep.gateway.schema import responses as rs
from lockstep.gateway.signing import FileRef, check_relative_path, signed_url
from lockstep.gateway.translate import runs as tr
from lockstep.gateway.translate.common import utc
from lockstep.gateway.validate import check_id, checkpoint_path, parse_tinker_path
from lockstep.v1 import scheduler_pb2 as pb

log = logging.getLogger("lockstep.gateway")

router = APIRouter(prefix="/api/v1", tags=["runs"])

CHECKPOINT = "/training_runs/{run_id}/checkpoints/{segment}/{name}"


@router.get("/get_server_capabilities")
async def get_server_capabilities(owner: Owner, stub: Scheduler) -> rs.ServerCapabilitiesResponse:
    caps = await stub.GetServerCapabilities(pb.CapabilitiesRequest(), timeout=CALL_TIMEOUT_S)
    return tr.capabilities(caps)


@router.get("/training_runs")
async def list_training_runs(
    scope: Reader, stub: Scheduler, limit: Limit = 20, offset: Offset = 0
) -> rs.TrainingRunsResponse:
    # project_id is accepted and ignored; access_scope=accessible reads every key's runs for an
    # admin key (deps.read_scope), a key's own for any other.
    reply = await stub.ListTrainingRuns(
        pb.ListRequest(owner=scope.owner, limit=limit, offset=offset, all_owners=scope.all_owners),
        timeout=CALL_TIMEOUT_S,
    )
    return tr.training_run_list(reply, offset, limit)


def _run_ref(scope: Scope, run_id: str) -> pb.RunRef:
    run_id = check_id("training_run_id", run_id)
    return pb.RunRef(owner=scope.owner, run_id=run_id, all_owners=scope.all_owners)


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, scope: Reader, stub: Scheduler) -> rs.TrainingRun:
    return tr.training_run(
        await stub.GetTrainingRun(_run_ref(scope, run_id), timeout=CALL_TIMEOUT_S)
    )


@router.get("/training_runs/{run_id}/history")
async def get_run_history(
    run_id: str,
    scope: Reader,
    stub: Scheduler,
    points: Annotated[int, Query(ge=0, le=1_000_000)] = 0,
) -> rs.RunHistoryResponse:
    """The run's metrics per optimizer step, as the scheduler committed them; with `points`,
    at most that many, each the mean of consecutive steps (its `steps` says how many)."""
    request = pb.RunHistoryRequest(run=_run_ref(scope, run_id), most_points=points)
    reply = await stub.GetRunHistory(request, timeout=CALL_TIMEOUT_S)
    return tr.run_history(run_id, reply)


@router.get("/training_runs/{run_id}/futures")
async def list_run_futures(run_id: str, scope: Reader, stub: Scheduler) -> rs.RunFuturesResponse:
    """The run's training requests still queued (their futures in flight)."""
    reply = await stub.ListRunFutures(_run_ref(scope, run_id), timeout=CALL_TIMEOUT_S)
    return tr.run_futures(run_id, reply)


@router.get("/training_runs/{run_id}/checkpoints")
async def list_run_checkpoints(
    run_id: str, scope: Reader, stub: Scheduler, limit: Limit = 10_000, offset: Offset = 0
) -> rs.CheckpointsListResponse:
    request = pb.ListCheckpointsRequest(
        owner=scope.owner,
        run_id=check_id("training_run_id", run_id),
        limit=limit,
        offset=offset,
        all_owners=scope.all_owners,
    )
    reply = await stub.ListCheckpoints(request, timeout=CALL_TIMEOUT_S)
    return tr.checkpoint_list(reply, offset, limit)


@router.get("/checkpoints")
async def list_checkpoints(
    owner: Owner, stub: Scheduler, limit: Limit = 100, offset: Offset = 0
) -> rs.CheckpointsListResponse:
    request = pb.ListCheckpointsRequest(owner=owner, limit=limit, offset=offset)
    reply = await stub.ListCheckpoints(request, timeout=CALL_TIMEOUT_S)
    return tr.checkpoint_list(reply, offset, limit)


def _ref(owner: str, run_id: str, segment: str, name: str) -> pb.CheckpointRef:
    return pb.CheckpointRef(owner=owner, tinker_path=str(checkpoint_path(run_id, segment, name)))


@router.delete(CHECKPOINT)
async def delete_checkpoint(
    run_id: str, segment: str, name: str, owner: Owner, stub: Scheduler
) -> dict[str, str]:
    await stub.DeleteCheckpoint(_ref(owner, run_id, segment, name), timeout=CALL_TIMEOUT_S)
    return {}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id}")
async def delete_checkpoint_bare(run_id: str, checkpoint_id: str, owner: Owner) -> None:
    """`delete_checkpoint(run, "ckpt-1")`: the id lacks its type segment; say so (not 404)."""
    raise bad_request(
        "checkpoint_id",
        f"{checkpoint_id!r} lacks its type: give '<type>/<name>' with type one of "
        "weights, sampler_weights, external_weights (e.g. 'weights/" + checkpoint_id + "')",
    )


@router.post(CHECKPOINT + "/publish")
async def publish_checkpoint(
    run_id: str, segment: str, name: str, owner: Owner, stub: Scheduler
) -> dict[str, str]:
    ref = _ref(owner, run_id, segment, name)
    await stub.SetCheckpointPublic(
        pb.SetCheckpointPublicRequest(ref=ref, public=True), timeout=CALL_TIMEOUT_S
    )
    return {}


@router.delete(CHECKPOINT + "/publish")
async def unpublish_checkpoint(
    run_id: str, segment: str, name: str, owner: Owner, stub: Scheduler
) -> dict[str, str]:
    ref = _ref(owner, run_id, segment, name)
    await stub.SetCheckpointPublic(
        pb.SetCheckpointPublicRequest(ref=ref, public=False), timeout=CALL_TIMEOUT_S
    )
    return {}


@router.put(CHECKPOINT + "/ttl")
async def set_checkpoint_ttl(
    run_id: str,
    segment: str,
    name: str,
    body: rq.CheckpointTtlRequest,
    owner: Owner,
    stub: Scheduler,
) -> dict[str, str]:
    request = pb.SetCheckpointTtlRequest(
        ref=_ref(owner, run_id, segment, name), ttl_seconds=body.ttl_seconds
    )
    await stub.SetCheckpointTtl(request, timeout=CALL_TIMEOUT_S)
    return {}


@router.get(CHECKPOINT + "/external_weights_urls")
async def external_weights_urls(
    run_id: str,
    segment: str,
    name: str,
    request: Request,
    owner: Owner,
    stub: Scheduler,
    settings: Settings,
    secret: FileUrlSecret,
) -> rs.ExternalWeightsUrlsResponse:
    """Signed URLs, served by this gateway without an auth header (`tinker checkpoint download`)."""
    files = await stub.GetCheckpointFiles(
        _ref(owner, run_id, segment, name), timeout=CALL_TIMEOUT_S
    )
    expires = int(time.time()) + settings.file_url_ttl_seconds
    if files.expires > 0:
        expires = min(expires, int(files.expires))
    base_url = settings.public_base_url or str(request.base_url)
    urls: dict[str, str] = {}
    for rel in files.relative_paths:
        try:
            check_relative_path(rel)
        except ApiError:
            log.warning("scheduler listed an unsafe file path %r in %s/%s", rel, run_id, name)
            continue
        urls[rel] = signed_url(
            base_url, FileRef(owner, run_id, segment, name, rel, expires), secret
        )
    return rs.ExternalWeightsUrlsResponse(urls=urls, expires=utc(expires))


@router.post("/weights_info")
async def weights_info(
    body: rq.WeightsInfoRequest, owner: Owner, stub: Scheduler
) -> rs.WeightsInfoResponse:
    path = parse_tinker_path("tinker_path", body.tinker_path)
    ref = pb.CheckpointRef(owner=owner, tinker_path=str(path))
    return tr.weights_info(await stub.GetWeightsInfo(ref, timeout=CALL_TIMEOUT_S))
