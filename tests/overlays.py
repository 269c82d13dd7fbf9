"""Packages a test needs beside the suite's own environment, installed once with
`pip --no-deps --target` into a cached directory (keyed by the requirements file and the Python
version) that the test puts on PYTHONPATH of a subprocess: the lowest transformers release
(tests/transformers_floor/), Triton and fla for fla's kernels in Triton's interpreter
(tests/fla_interpreter/)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

PIP_TIMEOUT_S = 900


def overlay(requirements: Path, name: str) -> Path:
    """The directory holding `requirements`' packages, built once (under a file lock)."""
    key = hashlib.sha256(requirements.read_bytes())
    key.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache / f"lockstep-{name}-{key.hexdigest()[:16]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = target / ".lockstep-ready"
        if marker.is_file():
            return target
        shutil.rmtree(target, ignore_errors=True)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            + ["--no-deps", "--target", str(target), "-r", str(requirements)],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"installing {requirements} failed:\n{proc.stderr[-3000:]}")
        marker.write_text(requirements.read_text())
        return target
