"""Run the real tinker-cookbook, unmodified, offline, against a real `lockstep serve`.

The cookbook lives in its own virtualenv (it pins transformers<=5.5.4 and its own torch, which
the service need not share): `cookbook_python` builds it once from `requirements.txt` (the pin)
and caches it under ~/.cache/lockstep-cookbook-venv-<hash of requirements.txt and Python>, so a
rerun starts at once and bumping the pin builds a fresh one. Set LOCKSTEP_COOKBOOK_VENV to use
another directory, or LOCKSTEP_SKIP_COOKBOOK=1 to skip these tests (e.g. with no package index).

Recipes run as subprocesses of that venv's python with the hub, datasets and every other
outbound HTTP request disabled (HF_*_OFFLINE, a dead proxy for everything but loopback). The
served model is the built-in tiny Qwen3 under its directory path (which is also its tokenizer
directory, so `model_name=<dir>` works in every recipe) and under a hub alias
(`ALIAS_MODEL`) for the recipe driven by a known model name.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lockstep.devserver import Server, start_server, stop_server
from tests.integration.conftest import API_KEY

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "requirements.txt"
DRIVERS = HERE / "drivers"
# A name tinker_cookbook.model_info knows (its recommended renderer is role_colon), served by
# `lockstep serve --model NAME=DIR` as an alias of the local tiny model.
ALIAS_MODEL = "meta-llama/Llama-3.2-1B"
PIP_TIMEOUT_S = 1800


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cookbook: runs tinker-cookbook recipes (own venv) against lockstep serve"
    )


def _venv_dir() -> Path:
    override = os.environ.get("LOCKSTEP_COOKBOOK_VENV")
    if override:
        return Path(override).expanduser()
    key = hashlib.sha256(REQUIREMENTS.read_bytes())
    key.update(f"{sys.version_info.major}.{sys.version_info.minor}".encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / f"lockstep-cookbook-venv-{key.hexdigest()[:16]}"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_cookbook_venv() -> Path:
    """The cookbook virtualenv's python, built (once, under a file lock) if missing."""
    venv = _venv_dir()
    marker = venv / ".lockstep-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.is_file():
            return _python(venv)
        shutil.rmtree(venv, ignore_errors=True)
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        proc = subprocess.run(
            [
                str(_python(venv)),
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "-r",
                str(REQUIREMENTS),
            ],
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            env=env,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"building the cookbook venv failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
            )
        check = subprocess.run(
            [
                str(_python(venv)),
                "-c",
                "import importlib.metadata as m, torch; "
                "print({p: m.version(p) for p in ('tinker', 'tinker-cookbook', 'transformers')}, "
                "torch.__version__)",
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if check.returncode != 0:
            raise RuntimeError(f"the cookbook venv does not import:\n{check.stderr[-3000:]}")
        marker.write_text(f"{check.stdout.strip()}\nbuilt in {time.monotonic() - started:.0f}s\n")
        return _python(venv)


def offline_env(home: Path, base_url: str | None = None) -> dict[str, str]:
    """The environment a cookbook process runs in: this process's, minus its Python and HF
    settings, offline (hub, datasets, any non-loopback HTTP), caches under `home`, and the
    server's address and key when there is one."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TINKER_", "HF_", "WANDB_"))
        and k not in ("PYTHONPATH", "VIRTUAL_ENV")
        and k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
    }
    dead_proxy = "http://127.0.0.1:9"  # nothing listens: any non-loopback request fails fast
    env.update(
        {
            "TINKER_COOKBOOK_RUNS_DIR": str(home / "runs"),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(home / "hf"),
            "WANDB_MODE": "disabled",
            "TOKENIZERS_PARALLELISM": "false",
            "http_proxy": dead_proxy,
            "https_proxy": dead_proxy,
            "HTTP_PROXY": dead_proxy,
            "HTTPS_PROXY": dead_proxy,
            "no_proxy": "127.0.0.1,localhost",
            "NO_PROXY": "127.0.0.1,localhost",
        }
    )
    if base_url is not None:
        env.update({"TINKER_BASE_URL": base_url, "TINKER_API_KEY": API_KEY})
    return env


@dataclass
class Running:
    """A recipe running in the background."""

    proc: subprocess.Popen[bytes]
    log: Path
    label: str
    started: float

    def wait(self, timeout: float = 600) -> str:
        """Its log once it exits; fails with the log's tail on a non-zero exit."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        text = self.log.read_text(errors="replace")
        print(f"[cookbook] {self.label} ... took {time.monotonic() - self.started:.1f}s")
        assert code == 0, f"exit {code}:\n{text[-6000:]}"
        return text


@dataclass
class Cookbook:
    """The cookbook venv, the server it talks to, and how to run a recipe against it."""

    python: Path
    server: Server
    model_dir: Path
    home: Path  # HF caches, TINKER_COOKBOOK_RUNS_DIR

    @property
    def package_dir(self) -> Path:
        out = subprocess.run(
            [
                str(self.python),
                "-c",
                "import os, tinker_cookbook; print(os.path.dirname(tinker_cookbook.__file__))",
            ],
            capture_output=True,
            text=True,
            check=True,
            env=self.env(),
        )
        return Path(out.stdout.strip())

    def env(self) -> dict[str, str]:
        return offline_env(self.home, self.server.base_url)

    def start(self, args: Sequence[str], log: Path) -> Running:
        """Start `python ARGS` in the cookbook venv, its output going to `log`."""
        with log.open("w") as out:
            proc = subprocess.Popen(
                [str(self.python), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=self.home,
            )
        return Running(proc, log, " ".join(str(a) for a in args[:3]), time.monotonic())

    def run(self, args: Sequence[str], log: Path, timeout: float = 600) -> str:
        """Run `python ARGS` in the cookbook venv; fail with the log's tail on a non-zero exit."""
        return self.start(args, log).wait(timeout)

    def recipe(self, module: str, log: Path, **config: Any) -> str:
        """`python -m MODULE key=value ...`: a recipe's own chz command line."""
        return self.run(["-m", module, *(f"{k}={v}" for k, v in config.items())], log)

    def driver(self, name: str, log: Path, **config: Any) -> Running:
        """Start a script of drivers/ (recipes the cookbook exposes as functions, not CLIs)."""
        return self.start([str(DRIVERS / name), json.dumps(config)], log)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def cookbook_python() -> Path:
    if os.environ.get("LOCKSTEP_SKIP_COOKBOOK"):
        pytest.skip("LOCKSTEP_SKIP_COOKBOOK is set")
    started = time.monotonic()
    python = ensure_cookbook_venv()
    print(f"[cookbook] venv {python.parent.parent} ready in {time.monotonic() - started:.1f}s")
    return python


@pytest.fixture(scope="session")
def cookbook(cookbook_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cookbook]:
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model

    root = tmp_path_factory.mktemp("cookbook")
    model_dir = ensure_default_model(root / "models")
    server = start_server(
        root / "data",
        "--model",
        str(model_dir),
        "--model",
        f"{DEFAULT_MODEL_NAME}={model_dir}",
        "--model",
        f"{ALIAS_MODEL}={model_dir}",
    )
    home = root / "home"
    home.mkdir()
    try:
        yield Cookbook(cookbook_python, server, model_dir, home)
    finally:
        code = stop_server(server)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{server.log()[-5000:]}"
