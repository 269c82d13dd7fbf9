"""One tinker:// rule and one ModelCard: the gateway and the scheduler agree on every path, and
every engine builds the same card from a model directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lockstep.engine.types import ModelCard
from lockstep.errors import UserInputError
from lockstep.gateway.errors import ApiError
from lockstep.gateway.validate import check_name, parse_tinker_path
from lockstep.paths import SEGMENT_TYPES, TYPE_SEGMENTS, TinkerPath

RUN = "sess-1:train:0"
PATHS = [
    f"tinker://{RUN}/weights/ckpt-1",
    f"tinker://{RUN}/sampler_weights/s0",
    f"tinker://{RUN}/external_weights/e.v2",
    f"tinker://{RUN}/weights/ckpt:1",  # ':' passed the gateway's old rule, not the scheduler's
    f"tinker://{RUN}/weights/..",
    f"tinker://{RUN}/weights/a@b",
    f"tinker://{RUN}/weights/" + "x" * 129,
    f"tinker://{RUN}/checkpoints/c",
    "tinker://not-a-run/weights/c",
    f"s3://{RUN}/weights/c",
    f"tinker://{RUN}/weights/a/b",
]


def _scheduler_accepts(path: str) -> bool:
    try:
        TinkerPath.parse(path)
    except UserInputError:
        return False
    return True


def _gateway_accepts(path: str) -> bool:
    try:
        parse_tinker_path("path", path)
    except ApiError as exc:
        assert exc.status_code == 400
        return False
    return True


@pytest.mark.parametrize("path", PATHS)
def test_gateway_and_scheduler_accept_the_same_paths(path: str) -> None:
    assert _gateway_accepts(path) == _scheduler_accepts(path)


def test_the_rule_is_not_vacuous() -> None:
    verdicts = [_scheduler_accepts(p) for p in PATHS]
    assert verdicts[:3] == [True, True, True] and not any(verdicts[3:])


@pytest.mark.parametrize("name", ["ckpt-1", "ckpt:1", "..", "a/b", "_x"])
def test_a_name_the_gateway_saves_under_is_one_the_scheduler_loads(name: str) -> None:
    try:
        check_name("path", name)
        saved = True
    except ApiError:
        saved = False
    assert saved == _scheduler_accepts(f"tinker://{RUN}/weights/{name}")


def test_segments_and_types_are_one_map() -> None:
    assert {TYPE_SEGMENTS[t]: t for t in SEGMENT_TYPES.values()} == SEGMENT_TYPES
    assert TinkerPath.parse(f"tinker://{RUN}/sampler_weights/s").checkpoint_type == "sampler"


def test_model_card_from_dir_reads_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3",
                "vocab_size": 1000,
                "max_position_embeddings": 4096,
                "eos_token_id": [7, 8],
            }
        )
    )
    card = ModelCard.from_dir(tmp_path, "m")
    assert (card.name, card.arch, card.vocab_size, card.max_context_length) == (
        "m",
        "qwen3",
        1000,
        4096,
    )
    assert card.eos_token_id == 7 and card.directory == str(tmp_path.resolve())
    # a multimodal config keeps the language model's settings in text_config
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "vlm", "text_config": {"vocab_size": 512, "eos_token_id": 3}})
    )
    card = ModelCard.from_dir(tmp_path, "m")
    assert (card.vocab_size, card.max_context_length, card.eos_token_id) == (512, 2048, 3)
