"""tinker:// checkpoint paths and where their files live under the data directory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lockstep.engine.interface import UserInputError

SEGMENT_TYPES = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
TYPE_SEGMENTS = {v: k for k, v in SEGMENT_TYPES.items()}

# Checkpoint names become one directory name: no separators, no "..", nothing exotic.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]+:train:[0-9]+$")


def validate_name(name: str, field: str = "path") -> str:
    if not _NAME.match(name) or ".." in name:
        raise UserInputError(
            field,
            f"checkpoint name {name!r} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (no '/', no '..')",
        )
    return name


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str  # "weights" | "sampler_weights" | "external_weights"
    name: str

    @property
    def checkpoint_type(self) -> str:
        return SEGMENT_TYPES[self.segment]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    @classmethod
    def parse(cls, path: str, field: str = "path") -> TinkerPath:
        if not path.startswith("tinker://"):
            raise UserInputError(field, f"{path!r} is not a tinker:// path")
        parts = path[len("tinker://"):].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENT_TYPES:
            raise UserInputError(
                field,
                f"{path!r} must look like tinker://<run>/(weights|sampler_weights|"
                "external_weights)/<name>",
            )
        if not _MODEL_ID.match(parts[0]):
            raise UserInputError(field, f"{parts[0]!r} is not a training run id")
        return cls(parts[0], parts[1], validate_name(parts[2], field))


def checkpoint_dir(data_dir: Path, path: TinkerPath) -> Path:
    return data_dir / "checkpoints" / path.model_id / path.segment / path.name


def ephemeral_dir(data_dir: Path, model_id: str, sampler_id: str) -> Path:
    """Unnamed save_weights_for_sampler snapshots (not listed as checkpoints)."""
    return data_dir / "checkpoints" / model_id / "ephemeral" / sampler_id.replace(":", "_")
