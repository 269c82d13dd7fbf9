"""The command lines are generated from the root config and frozen.

Every flag of `lockstep serve`, `python -m lockstep.scheduler` and `python -m lockstep.gateway`
is one field of lockstep.config (see its docstring for how to add one); the accepted spellings
are listed in cli_surface.txt. A flag added by hand, a flag added without updating that list,
two fields claiming one spelling, or a flag that disappears fails here.
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import pytest

from lockstep import cli, config
from lockstep.config import LockstepConfig
from lockstep.config.flags import leaves
from lockstep.gateway.__main__ import build_parser as gateway_parser
from lockstep.scheduler.server import build_parser as scheduler_parser

SURFACE = Path(__file__).with_name("cli_surface.txt")
# Flags that are not settings: the config file itself, and the demo's own knob.
NOT_SETTINGS = {"--config", "--help", "-h", "--steps"}


def frozen() -> dict[str, set[str]]:
    """cli_surface.txt: `[command]` headers, one flag per line."""
    out: dict[str, set[str]] = {}
    current = None
    for line in SURFACE.read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = out.setdefault(line[1:-1], set())
        elif line and not line.startswith("#"):
            assert current is not None, f"{SURFACE.name}: {line} before any [command]"
            current.add(line)
    return out


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def parsers() -> dict[str, argparse.ArgumentParser]:
    _, commands = cli.build_parser()
    return {
        "serve": commands["serve"],
        "demo": commands["demo"],
        "scheduler": scheduler_parser(),
        "gateway": gateway_parser(),
    }


@pytest.mark.parametrize("command", ["serve", "demo", "scheduler", "gateway"])
def test_the_surface_is_frozen(command: str) -> None:
    actual = options(parsers()[command]) - {"-h", "--help"}
    listed = frozen()[command]
    assert not actual - listed, (
        f"new {command} flags {sorted(actual - listed)}: declare each as a config field "
        f"(lockstep/config) and list it in {SURFACE.name}"
    )
    assert not listed - actual, f"{command} lost flags {sorted(listed - actual)}"


@pytest.mark.parametrize("command", ["serve", "scheduler", "gateway"])
def test_every_flag_is_one_config_field(command: str) -> None:
    """No hand-declared flag beside the generated ones, and no spelling claimed twice."""
    spellings = [
        name
        for leaf in leaves(LockstepConfig)
        for name in (
            *leaf.flag.names,
            *leaf.flag.deprecated,
            *(n for n, _, _ in leaf.flag.scaled),
        )
    ]
    twice = [name for name, n in Counter(spellings).items() if n > 1]
    assert not twice, f"flags declared by two config fields: {twice}"
    by_hand = options(parsers()[command]) - set(spellings) - NOT_SETTINGS
    assert not by_hand, f"{command} flags not generated from lockstep.config: {sorted(by_hand)}"


def test_serve_hands_its_children_the_config_not_flags(tmp_path: Path) -> None:
    """The config `lockstep serve` resolves reaches a child unchanged through --config FILE."""
    parser, commands = cli.build_parser()
    argv = ["serve", "--data-dir", str(tmp_path), "--clock-gather", "0.25", "--future-ttl", "90"]
    argv += ["--max-body-mb", "3", "--sampler", "vllm", "--max-lora-rank", "16", "--tp", "1"]
    a = parser.parse_args(argv)
    cfg = config.resolve(commands["serve"], LockstepConfig(), a, "serve")
    cfg = config.flags.replace_paths(
        cfg,
        {
            ("scheduler", "listen"): "127.0.0.1:1",
            ("scheduler", "redis_url"): "redis://r",
            ("model", "dir"): tmp_path,
            ("model", "served_names"): ("m",),
        },
    )
    path = tmp_path / "config.json"
    config.save(cfg, path)
    assert path.stat().st_mode & 0o077 == 0, "the file can hold API keys: owner only"
    assert config.load(path) == cfg
    from lockstep.scheduler.server import parse_args

    sched = parse_args(["--config", str(path)])
    assert (sched.clock.gather_s, sched.limits.future_ttl_s) == (0.25, 90)
    assert (sched.sampler.kind, sched.limits.max_lora_rank) == ("vllm", 16)
    assert cfg.limits.max_body_bytes == 3 * 1024 * 1024
    # a flag beside --config overrides that one field
    assert parse_args(["--config", str(path), "--token-budget", "7"]).clock.token_budget == 7


def test_the_old_spelling_still_works_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    a = scheduler_parser().parse_args(["--future-ttl-s", "5"])
    assert a.future_ttl == 5
    assert "--future-ttl-s is deprecated; use --future-ttl" in caplog.text


def test_bad_values_are_usage_errors_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser, commands = cli.build_parser()
    a = parser.parse_args(["serve", "--tp", "2"])
    with pytest.raises(SystemExit) as exc:
        config.resolve(commands["serve"], LockstepConfig(), a, "serve")
    assert exc.value.code == 2
    assert "need --engine megatron" in capsys.readouterr().err
