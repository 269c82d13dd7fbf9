"""The lowest supported transformers release, in a second environment.

The suite's own environment has the newest release the range allows (constraints.txt pins it);
this test runs the model tests again under the LOWEST release (tests/transformers_floor/
requirements.txt), installed once with `pip --target` into a cached directory that shadows the
suite's transformers on PYTHONPATH, the way a carried wheel shadows a GPU image's own. Every
family of the zoo (every MoE layout among them) loads, trains and samples there with the same
numbers as its model's own forward; the (adapter, expert) group limit and the vision towers are
checked there too. Set LOCKSTEP_SKIP_TRANSFORMERS_FLOOR=1 to skip (e.g. with no package index).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.modeling import transformers_range
from tests.overlays import overlay

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "tests" / "transformers_floor" / "requirements.txt"
# The model tests rerun under the floor: every family's load, numbers and adapter format.
MODEL_TESTS = (
    "tests/unit/test_architectures.py",
    "tests/unit/test_moe_lora.py",
    "tests/unit/test_grouped_gemm.py",
    "tests/unit/test_vision_models.py",
    "tests/unit/test_training_kernels.py",
    "tests/unit/test_local_sampler.py",
    "tests/unit/test_hybrid_kernels.py",
)


def _pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def _overlay() -> Path:
    """The directory holding the floor's packages, built once (under a file lock) if missing."""
    return overlay(REQUIREMENTS, "transformers-floor")


def test_the_floor_is_the_ranges_lowest_release() -> None:
    assert _pins()["transformers"] == transformers_range.LOWEST


@pytest.mark.skipif(
    os.environ.get("LOCKSTEP_SKIP_TRANSFORMERS_FLOOR") == "1",
    reason="LOCKSTEP_SKIP_TRANSFORMERS_FLOOR=1: the lowest transformers release is NOT tested",
)
def test_the_model_tests_pass_on_the_lowest_release() -> None:
    # fla's kernels in Triton's interpreter do not depend on transformers: checked once, in the
    # suite's own environment.
    env = {**os.environ, "PYTHONPATH": str(_overlay()), "LOCKSTEP_SKIP_FLA_INTERPRETER": "1"}
    seen = subprocess.run(
        [sys.executable, "-c", "import transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.strip()
    assert seen == transformers_range.LOWEST  # the overlay shadows the suite's own release
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *MODEL_TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1]
