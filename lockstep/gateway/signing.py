"""Signed, expiring download URLs for checkpoint files, and safe path resolution.

`tinker checkpoint download` fetches every URL of `external_weights_urls` with a plain
`urlopen` and no auth header, so each URL carries its own proof: an HMAC-SHA256 over the
owner, the checkpoint path, the file's relative path and the expiry time. At download time
the gateway re-asks the scheduler for the checkpoint's file list (as that owner), serves only
a file that is on that list, and only if it resolves inside the checkpoint's directory.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urlencode

from lockstep.gateway.errors import ApiError

FILES_PREFIX = "/api/v1/checkpoint_files"


@dataclass(frozen=True)
class FileRef:
    """What one signed URL grants: one file of one owner's checkpoint, until `expires`."""

    owner: str
    run_id: str
    segment: str  # "weights" | "sampler_weights" | "external_weights"
    name: str
    relative_path: str
    expires: int  # unix seconds

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.run_id}/{self.segment}/{self.name}"


def _message(ref: FileRef) -> bytes:
    # Fields are joined with NUL, which none of them may contain, so the encoding is unique.
    parts = (ref.owner, ref.tinker_path, ref.relative_path, str(ref.expires))
    if any("\0" in p for p in parts):
        raise ValueError("NUL in a signed field")
    return "\0".join(parts).encode()


def sign(ref: FileRef, secret: bytes) -> str:
    return hmac.new(secret, _message(ref), hashlib.sha256).hexdigest()


def verify(ref: FileRef, signature: str, secret: bytes, now: float | None = None) -> None:
    """Raise a 403 ApiError unless `signature` is valid for `ref` and not expired."""
    try:
        expected = sign(ref, secret)
    except ValueError as e:
        raise ApiError(403, "invalid download signature") from e
    # bytes: compare_digest refuses (TypeError) a str with non-ASCII characters
    if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
        raise ApiError(403, "invalid download signature")
    if (time.time() if now is None else now) > ref.expires:
        raise ApiError(403, "download URL expired; request new URLs")


def check_relative_path(relative_path: str) -> str:
    """A relative file path that cannot leave its directory, else a 400 ApiError."""
    p = PurePosixPath(relative_path)
    if (
        not relative_path
        or "\\" in relative_path
        or "\0" in relative_path
        or p.is_absolute()
        or any(part in ("", ".", "..") for part in relative_path.split("/"))
    ):
        raise ApiError(400, f"file path {relative_path!r} is not a plain relative path")
    return relative_path


def url_path(ref: FileRef) -> str:
    """The path component of the signed URL (each segment percent-encoded)."""
    segments = [ref.owner, ref.run_id, ref.segment, ref.name, *ref.relative_path.split("/")]
    return FILES_PREFIX + "/" + "/".join(quote(s, safe=":") for s in segments)


def signed_url(base_url: str, ref: FileRef, secret: bytes) -> str:
    query = urlencode({"expires": ref.expires, "sig": sign(ref, secret)})
    return f"{base_url.rstrip('/')}{url_path(ref)}?{query}"


def resolve_inside(directory: str, relative_path: str) -> Path:
    """`directory/relative_path`, refusing anything that resolves outside `directory`."""
    check_relative_path(relative_path)
    root = Path(directory).resolve()
    target = (root / relative_path).resolve()
    if not target.is_relative_to(root):
        raise ApiError(404, "file not found")
    return target
