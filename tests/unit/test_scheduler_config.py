"""The scheduler's command line: a remote sampler's rank ceiling also bounds training runs."""

from __future__ import annotations

from pathlib import Path

from lockstep.scheduler.server import parse_args


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--listen",
        "127.0.0.1:0",
        "--redis-url",
        "redis://127.0.0.1:1",
        "--data-dir",
        str(tmp_path),
        "--model-dir",
        str(tmp_path),
        "--served-name",
        "m",
        *extra,
    ]


def test_remote_sampler_rank_bounds_training_runs(tmp_path: Path) -> None:
    cfg = parse_args(_args(tmp_path, "--sampler", "vllm", "--max-lora-rank", "32"))
    assert (cfg.sampler.max_lora_rank, cfg.limits.max_lora_rank) == (32, 32)


def test_local_sampler_keeps_the_training_rank_limit(tmp_path: Path) -> None:
    cfg = parse_args(_args(tmp_path, "--max-lora-rank", "32"))
    assert cfg.limits.max_lora_rank == 512  # the local sampler serves any rank the trainer has
