"""The transformers releases Lockstep reads, declared once.

`pyproject.toml` asks for the same range (tests/unit/test_transformers_range.py keeps the two
equal). The lowest release is the oldest the test suite runs (tests/unit/test_transformers_floor.py
in a second environment: the experts layouts and every MoE family's load); the suite's own
environment takes the newest. Below the floor Lockstep refuses to start, naming the version (an
older transformers lacks modules and model families Lockstep imports); above the tested range it
warns, and refuses at load only what it cannot read (`experts.experts_layout`).

GPU images often ship their own transformers (the measured H200 image: 5.17), so the floor is
kept as low as the families allow, not at the newest release.
"""

from __future__ import annotations

import logging

import transformers
from packaging.version import Version

from lockstep.errors import UnsupportedModel

# The release range pyproject.toml declares and the suite tests (its lowest and highest).
LOWEST = "5.17.0"
BELOW = "6"  # the next major release changes module layouts without notice
TESTED_HIGHEST = "5.24.0"
REQUIREMENT = f"transformers>={LOWEST.removesuffix('.0')},<{BELOW}"

log = logging.getLogger(__name__)


def installed() -> str:
    """The transformers release this process imports (a GPU image's own, or one shadowing it)."""
    return str(transformers.__version__)


def check(version: str | None = None) -> None:
    """Refuse a transformers older than the floor or of another major release; warn once about
    one newer than the newest tested (what it cannot read is refused at load, by name)."""
    version = version or installed()
    found = Version(version)
    if found < Version(LOWEST) or found >= Version(BELOW):
        raise UnsupportedModel(
            f"transformers {version} is outside the range Lockstep supports ({REQUIREMENT}; "
            f"tested {LOWEST} to {TESTED_HIGHEST}): pip install '{REQUIREMENT}'"
        )
    if found.release > Version(TESTED_HIGHEST).release:
        log.warning(
            "transformers %s is newer than the newest release Lockstep is tested with (%s); "
            "a model part it cannot read is refused at load",
            version,
            TESTED_HIGHEST,
        )
