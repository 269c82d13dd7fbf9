"""One root config for every Lockstep process, composed of frozen dataclasses.

`LockstepConfig` holds the sections (clock, limits, sampler, engine, metrics, model, gateway,
scheduler process). The three command lines are generated from it:

- `lockstep serve` (lockstep/cli.py): every user-facing setting;
- `python -m lockstep.scheduler` and `python -m lockstep.gateway` (what the Helm chart runs,
  one pod each): the settings that process reads, plus its wiring (`--listen`, `--scheduler`).

`lockstep serve` does not re-declare flags for its children: it resolves the config once,
writes it as JSON (`to_json`, a 0600 file in the data dir) and starts each child with
`--config FILE`. Any command line accepts `--config FILE` as its base; flags given beside it
override single fields.

Adding a setting = adding ONE dataclass field to the section it belongs to::

    micro_batch_tokens: int = field(
        default=8192,
        metadata=flag("--micro-batch-tokens", help="tokens per micro-batch", on=SCHEDULER),
    )

`on` says which command lines have the flag (SCHEDULER = `lockstep serve` and the scheduler,
GATEWAY = `lockstep serve` and the gateway, EVERYWHERE, or *_ONLY for a child's wiring). The
type, choices (a Literal), on/off switch (bool), repeatable (tuple[str, ...]) and default come
from the field; the process reads it as `cfg.<section>.<field>`. A field without `flag(...)` is
config-file only. Then add the flag to tests/unit/cli_surface.txt (the frozen surface, checked
by tests/unit/test_cli_surface.py) and, if it is user-facing, to docs/operations.md. An old
spelling that must keep working goes in `deprecated=(...)`, never as a second field.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.config.flags import Cli, add_flags, flag, from_json, from_namespace, to_json
from lockstep.config.limits import Limits
from lockstep.config.sections import (
    ClockConfig,
    GatewayConfig,
    LogLevel,
    MetricsConfig,
    ModelConfig,
    SamplerConfig,
    SchedulerProcessConfig,
)
from lockstep.config.tenancy import TenancyConfig
from lockstep.config.training import EngineConfig, ParallelConfig

DEFAULT_DATA_DIR = Path(os.path.expanduser("~/.lockstep"))


@dataclass(frozen=True)
class LockstepConfig:
    data_dir: Path = field(
        default=DEFAULT_DATA_DIR,
        metadata=flag(
            "--data-dir",
            help="checkpoints, Redis append-only files and built models",
            on=frozenset({"serve", "scheduler"}),
        ),
    )
    log_level: LogLevel = field(
        default="info",
        metadata=flag(
            "--log-level",
            help="log level (debug logs every HTTP call; else the failed ones)",
            on=frozenset({"serve", "gateway"}),
        ),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    clock: ClockConfig = field(default_factory=ClockConfig)
    limits: Limits = field(default_factory=Limits)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    scheduler: SchedulerProcessConfig = field(default_factory=SchedulerProcessConfig)
    tenancy: TenancyConfig = field(default_factory=TenancyConfig)


def load(path: Path) -> LockstepConfig:
    cfg: LockstepConfig = from_json(path.read_bytes(), LockstepConfig)
    return cfg


def save(cfg: LockstepConfig, path: Path) -> None:
    """Write `cfg` as JSON, readable by its owner only (it can hold API keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(to_json(cfg))


def build_parser(cli: Cli, base: LockstepConfig, **kwargs: Any) -> argparse.ArgumentParser:
    """The parser of command line `cli`, its defaults taken from `base`."""
    parser = argparse.ArgumentParser(**kwargs)
    add_arguments(parser, cli, base)
    return parser


def add_arguments(parser: argparse.ArgumentParser, cli: Cli, base: LockstepConfig) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a config file (JSON, as `lockstep serve` writes for its children) to start from; "
        "flags override its fields",
    )
    add_flags(parser, base, cli)


def base_config(argv: list[str] | None) -> LockstepConfig:
    """The config `--config FILE` in `argv` names, else the defaults."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=Path, default=None)
    known, _ = pre.parse_known_args(argv)
    return load(known.config) if known.config is not None else LockstepConfig()


def resolve(
    parser: argparse.ArgumentParser, base: LockstepConfig, ns: argparse.Namespace, cli: Cli
) -> LockstepConfig:
    try:
        cfg: LockstepConfig = from_namespace(base, ns, cli)
    except ValueError as exc:
        parser.error(str(exc))
    return cfg


__all__ = [
    "DEFAULT_DATA_DIR",
    "ClockConfig",
    "EngineConfig",
    "GatewayConfig",
    "Limits",
    "LockstepConfig",
    "MetricsConfig",
    "ModelConfig",
    "ParallelConfig",
    "SamplerConfig",
    "SchedulerProcessConfig",
    "TenancyConfig",
    "add_arguments",
    "base_config",
    "build_parser",
    "load",
    "resolve",
    "save",
]
