"""The transformers range: declared once, refused by version outside it, and an experts layout
a release declares but Lockstep does not compute refused by name at load."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import transformers

from lockstep.errors import UnsupportedModel
from lockstep.modeling import experts, transformers_range, zoo
from lockstep.modeling.architecture import describe_dir

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_declares_the_range_the_code_reads() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert transformers_range.REQUIREMENT in deps


def test_the_suite_runs_the_newest_tested_release() -> None:
    pins = (ROOT / "constraints.txt").read_text()
    assert f"transformers=={transformers_range.TESTED_HIGHEST}\n" in pins
    assert transformers.__version__ == transformers_range.TESTED_HIGHEST


@pytest.mark.parametrize("version", ["4.57.1", "5.16.1", "6.0.0"])
def test_a_release_outside_the_range_is_refused_by_its_version(version: str) -> None:
    with pytest.raises(UnsupportedModel, match=rf"transformers {re.escape(version)} .*>=5\.17"):
        transformers_range.check(version)


def test_a_release_newer_than_tested_is_served_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        transformers_range.check("5.99.0")
        transformers_range.check(transformers_range.LOWEST)
    assert [r.getMessage() for r in caplog.records if "newer" in r.getMessage()] == [
        "transformers 5.99.0 is newer than the newest release Lockstep is tested with "
        f"({transformers_range.TESTED_HIGHEST}); a model part it cannot read is refused at load"
    ]


def test_experts_a_release_lays_out_in_an_unknown_way_are_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A release whose experts declare a layout flag Lockstep does not compute (here a made-up
    `has_router_bias`): every MoE family is refused at load, naming the release and the flag,
    instead of training its experts wrong or frozen."""
    directory = zoo.ensure_family("qwen3_moe", tmp_path)
    assert describe_dir(directory).experts  # read as it is
    declared = experts.declared_flags() | {"has_router_bias"}
    monkeypatch.setattr(experts, "declared_flags", lambda: declared)
    message = (
        rf"experts \(Qwen3MoeExperts\).*transformers {re.escape(transformers.__version__)}: it "
        r"declares experts layout flags Lockstep does not compute: \['has_router_bias'\]"
    )
    with pytest.raises(UnsupportedModel, match=message):
        describe_dir(directory)


def test_lockstep_serve_refuses_an_old_transformers_by_its_version(tmp_path: Path) -> None:
    """What a user with transformers 4.57 sees: one line naming the release and the range
    (4.57.1 used to stop the engine with a ModuleNotFoundError of a transformers module)."""
    code = (
        "import sys, transformers; transformers.__version__ = '4.57.1'; "
        "from pathlib import Path; from lockstep import cli; "
        "cli.resolve_models([], Path(sys.argv[1]))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("lockstep: transformers 4.57.1 is outside the range"), last
    assert "transformers>=5.17,<6" in last, last
