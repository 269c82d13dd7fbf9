"""`GET /api/v1/checkpoint_files/...`: the signed download URLs of `external_weights_urls`.

No API key: the URL's HMAC signature is the credential. The file is served only if it is on
the checkpoint's file list (asked again of the scheduler, as the signed owner) and resolves
inside the checkpoint's directory. The gateway must see the same file system as the scheduler.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from fastapi import APIRouter
from fastapi.responses import FileResponse

from lockstep.gateway.deps import CALL_TIMEOUT_S, FileUrlSecret, Scheduler
from lockstep.gateway.errors import ApiError
from lockstep.gateway.signing import FILES_PREFIX, FileRef, resolve_inside, verify
from lockstep.v1 import scheduler_pb2 as pb

router = APIRouter(tags=["files"])


@router.get(FILES_PREFIX + "/{owner}/{run_id}/{segment}/{name}/{relative_path:path}")
async def checkpoint_file(
    owner: str,
    run_id: str,
    segment: str,
    name: str,
    relative_path: str,
    expires: int,
    sig: str,
    stub: Scheduler,
    secret: FileUrlSecret,
) -> FileResponse:
    ref = FileRef(owner, run_id, segment, name, relative_path, expires)
    verify(ref, sig, secret)
    files = await stub.GetCheckpointFiles(
        pb.CheckpointRef(owner=owner, tinker_path=ref.tinker_path), timeout=CALL_TIMEOUT_S
    )
    if relative_path not in files.relative_paths:
        raise ApiError(404, "file not found")
    target = resolve_inside(files.directory, relative_path)
    if not target.is_file():
        raise ApiError(404, "file not found")
    return FileResponse(target, filename=PurePosixPath(relative_path).name)
