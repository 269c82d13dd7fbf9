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

import inspect
import logging
from typing import TYPE_CHECKING

import transformers
from packaging.version import Version

from lockstep.errors import UnsupportedModel

if TYPE_CHECKING:  # annotations only: the range is checked without importing torch
    import torch

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


# A model's forward takes its KV cache as `cache` from the release that renamed it (model by
# model in 5.2x; the old name warns, and goes in 5.40) and as `past_key_values` before (5.17).
CACHE_ARGUMENTS = ("cache", "past_key_values")


def cache_argument(module: torch.nn.Module) -> str:
    """The keyword `module.forward` takes its KV cache by in the installed release; a forward
    that names neither is refused by name (a cache passed under a name it ignores would be
    dropped silently, and every decode step would see no past)."""
    parameters = inspect.signature(module.forward).parameters
    for name in CACHE_ARGUMENTS:
        if name in parameters:
            return name
    raise UnsupportedModel(
        f"{type(module).__name__}.forward takes its KV cache by none of {CACHE_ARGUMENTS} "
        f"under transformers {installed()}"
    )
