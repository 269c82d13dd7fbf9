"""tinker:// checkpoint paths: the one parser and naming rule the gateway and the scheduler share,
the checkpoint types, and where a checkpoint's files live under the data directory.

`tinker://<run>/<segment>/<name>`: `<run>` is a training run id (`<session>:train:<n>`),
`<segment>` one of SEGMENT_TYPES (the URL spelling of a checkpoint type), `<name>` a checkpoint
name (validate_name). A path the gateway lets through is a path the scheduler accepts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from lockstep.errors import UserInputError
from lockstep.vocab import CheckpointType

# URL segment -> checkpoint type (what the REST API and the SDK call `checkpoint_type`).
SEGMENT_TYPES = {
    "weights": CheckpointType.TRAINING,
    "sampler_weights": CheckpointType.SAMPLER,
    "external_weights": CheckpointType.EXTERNAL,
}
TYPE_SEGMENTS = {v: k for k, v in SEGMENT_TYPES.items()}

# Checkpoint names become one directory name: no separators, no "..", nothing exotic.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9._-]+:train:[0-9]+$")


def validate_name(name: str, field: str = "path") -> str:
    """Raises UserInputError naming `field` unless `name` is a valid checkpoint name."""
    if not _NAME.match(name) or ".." in name:
        raise UserInputError(
            field,
            f"{name!r} is not a valid checkpoint name: use 1-128 letters, digits, '.', '_' or "
            "'-', starting with a letter or digit (no '/', no '..')",
        )
    return name


def validate_run_id(run_id: str, field: str = "path") -> str:
    if not _MODEL_ID.match(run_id):
        raise UserInputError(field, f"{run_id!r} is not a training run id")
    return run_id


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    segment: str  # a key of SEGMENT_TYPES
    name: str

    @property
    def checkpoint_type(self) -> CheckpointType:
        return SEGMENT_TYPES[self.segment]

    @property
    def checkpoint_id(self) -> str:
        return f"{self.segment}/{self.name}"

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{self.segment}/{self.name}"

    @classmethod
    def parse(cls, path: str, field: str = "path") -> TinkerPath:
        """Raises UserInputError naming `field` for anything but a valid tinker:// path."""
        if not path.startswith("tinker://"):
            raise UserInputError(field, f"{path!r} is not a tinker:// path")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or parts[1] not in SEGMENT_TYPES:
            raise UserInputError(
                field,
                f"{path!r} must look like tinker://<run>/(weights|sampler_weights|"
                "external_weights)/<name>",
            )
        return cls(validate_run_id(parts[0], field), parts[1], validate_name(parts[2], field))


def checkpoint_dir(data_dir: Path, path: TinkerPath) -> Path:
    return data_dir / "checkpoints" / path.model_id / path.segment / path.name


def ephemeral_dir(data_dir: Path, model_id: str, sampler_id: str) -> Path:
    """Unnamed save_weights_for_sampler snapshots (not listed as checkpoints)."""
    return data_dir / "checkpoints" / model_id / "ephemeral" / sampler_id.replace(":", "_")
