"""A background writer for model snapshots, shared by the training engines.

`TrainingEngine.snapshot` copies the model's state (host copies, taken on the engine's own thread
between two calls, so they are consistent) and hands a `write(directory)` closure here; the cycle
goes on while one writer thread writes it under `<dir>.tmp`, fsyncs every file and the directory,
renames it into place and fsyncs the parent. Only then is it reported by `durable()`: the
scheduler records a snapshot in Redis only once it would survive a crash or a power loss.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)


def fsync_tree(directory: Path) -> None:
    """Flush every file under `directory` and the directory entries themselves to disk."""
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotWriter:
    """One background thread writing snapshots in the order they were taken."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="snapshot-writer")
        self._lock = threading.Lock()
        self._done: list[tuple[str, Path]] = []
        self.bytes_written = 0

    def submit(self, model_id: str, directory: Path, write: Callable[[Path], int]) -> None:
        """Write `directory` with `write(tmp_dir)` in the background (a copy of the state)."""
        self._pool.submit(self._write, model_id, Path(directory), write)

    def _write(self, model_id: str, directory: Path, write: Callable[[Path], int]) -> None:
        tmp = directory.with_name(directory.name + ".tmp")
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            size = write(tmp)
            fsync_tree(tmp)
            shutil.rmtree(directory, ignore_errors=True)
            tmp.rename(directory)
            fsync_dir(directory.parent)
        except Exception:  # never recorded: the previous snapshot and the replay log stand
            log.exception("background snapshot of %s into %s failed", model_id, directory)
            shutil.rmtree(tmp, ignore_errors=True)
            return
        with self._lock:
            self._done.append((model_id, directory))
            self.bytes_written += size

    def durable(self) -> list[tuple[str, Path]]:
        """Snapshots complete on disk since the last call, each reported once."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def flush(self) -> None:
        """Wait for every snapshot taken so far (tests; a clean shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
