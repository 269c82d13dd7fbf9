"""A released Lockstep, built from its commit, beside the code under test.

`release_python(release)` exports the release's commit (`git archive`) into a cache directory
keyed by the commit, the Python version and the suite's environment, makes a virtualenv there
and installs the release into it without dependencies (the suite's pip and setuptools build
it): the environment's own `site-packages` comes first, then (one line in a `.pth` file) the
suite's, so the release imports its own `lockstep` and everything else (torch, transformers,
the Redis binary) from the suite's environment, from disk. Built once under a file lock; a
later run (or another worker) finds it ready. A release whose dependencies the suite's
environment no longer satisfies fails its import check here, loudly.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

from tests.changelog import ROOT, Release

PIP_TIMEOUT_S = 900


def _cache(release: Release) -> Path:
    assert release.commit is not None
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    # The suite's environment it borrows packages from is part of the key: another checkout's
    # environment (which may be gone) is never borrowed.
    suite = hashlib.sha256(sysconfig.get_paths()["purelib"].encode()).hexdigest()[:8]
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return base / f"lockstep-release-{release.version}-{release.commit[:12]}-{py}-{suite}"


def _run(argv: list[str], cwd: Path | None = None, timeout: float | None = None) -> str:
    """`argv`'s output; its errors, loudly. Run outside this checkout's Python settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:5])} ... failed:\n{proc.stderr[-4000:]}")
    return proc.stdout


def release_python(release: Release) -> Path:
    """The python of an environment running `release` (built once, cached)."""
    assert release.commit is not None
    home = _cache(release)
    python = home / "venv" / "bin" / "python"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{home.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = home / ".lockstep-ready"
        if marker.is_file():
            return python
        shutil.rmtree(home, ignore_errors=True)
        started = time.monotonic()
        src = home / "src"
        src.mkdir(parents=True)
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", release.commit],
            capture_output=True,
            check=False,
        )
        if archive.returncode != 0:
            raise RuntimeError(
                f"git archive {release.commit} (release {release.version}) failed: "
                f"{archive.stderr.decode(errors='replace')}; fetch the commit (git fetch "
                "--unshallow)"
            )
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(src, filter="data")
        _run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")])
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = Path(_run([str(python), "-c", where]).strip())
        (site / "lockstep-suite-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        _run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
            + ["--disable-pip-version-check"]
            + ["--no-deps", "--no-build-isolation", "--no-index", str(src)],
            timeout=PIP_TIMEOUT_S,
            cwd=home,
        )
        check = "import lockstep, torch; print(lockstep.__version__)"
        seen = _run([str(python), "-c", check], cwd=home).strip()
        if seen != release.version:
            raise RuntimeError(f"the environment of {release} imports Lockstep {seen}")
        marker.write_text(f"{release}\nbuilt in {time.monotonic() - started:.0f}s\n")
        return python
