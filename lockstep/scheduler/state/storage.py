"""Writing checkpoint and snapshot directories: all or nothing, and a full disk said plainly.

An engine writes a directory of files (safetensors, JSON). If the disk fills up halfway, the
half-written directory must not be left where a checkpoint is looked for, and the caller must
hear "out of disk space", not a generic server error: the request fails (its future completes
with an error the SDK raises at once, never retries) and the service keeps running, so the same
save works again once space is freed.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What libraries that do their own I/O say instead of raising OSError: safetensors (Rust) gives
# "IoError(Os { code: 28, kind: StorageFull, .. })", torch.save "file write failed".
_NO_SPACE_TEXT = ("No space left on device", "StorageFull", "Disk quota exceeded")


def is_out_of_space(exc: BaseException) -> bool:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in _NO_SPACE_ERRNOS:
            return True
        if any(text in str(cur) for text in _NO_SPACE_TEXT):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def out_of_space_message(what: str) -> str:
    return (
        f"{what} failed: the server is out of disk space (nothing was recorded; retry once "
        "space is freed)"
    )


@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yields a scratch directory beside `final` to write into; on success it replaces `final`,
    on any error it is removed, so `final` is either the old complete directory or the new one."""
    tmp = final.with_name(f".{final.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
