"""The `lockstep` command: `serve` runs the service, `demo` shows it training."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from lockstep import admin as admin_mod
from lockstep import config
from lockstep.config import LockstepConfig
from lockstep.config.flags import replace_paths
from lockstep.errors import UnsupportedModel
from lockstep.supervisor import run
from lockstep.version import STATE_FORMAT, VERSION


def resolve_models(
    specs: list[str], data_dir: Path, vision: bool = False
) -> tuple[Path, tuple[str, ...]]:
    """`--model` values -> (the one local model directory, the names it is served under).

    A value is `DIR` (served under its path) or `NAME=DIR` (an alias, e.g. a hub name a recipe
    insists on). With none, the built-in tiny Qwen3 model is built (once) under the data dir, or
    with `vision` (the demo's --vision) a tiny Qwen3-VL vision-language model.
    """
    try:  # the first import of lockstep.modeling: refuses a transformers outside the range
        from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
    except UnsupportedModel as exc:
        raise SystemExit(f"lockstep: {exc}") from exc

    if not specs and vision:
        from lockstep.demo.data import VISION_DEMO_MODEL
        from lockstep.modeling.vision import zoo

        built = zoo.ensure_family(VISION_DEMO_MODEL, data_dir / "models")
        return built, (zoo.served_name(VISION_DEMO_MODEL),)
    if not specs:
        return ensure_default_model(data_dir / "models"), (DEFAULT_MODEL_NAME,)
    directory: Path | None = None
    names: list[str] = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        local = Path(path).expanduser().resolve()
        if not (local / "config.json").is_file():
            raise SystemExit(
                f"--model {spec}: {local} is not a local Hugging Face model "
                "directory (config.json missing); downloads are not supported"
            )
        if directory is not None and local != directory:
            raise SystemExit(
                "--model: all names must point to the same directory "
                "(one base model is shared by every tenant)"
            )
        directory = local
        names.append(name or str(local))
    assert directory is not None
    return directory, tuple(dict.fromkeys(names))


def add_serve_args(p: argparse.ArgumentParser, base: LockstepConfig | None = None) -> None:
    """Every `lockstep serve` flag, generated from the config (lockstep/config)."""
    config.add_arguments(p, "serve", base or LockstepConfig())


def serve_config(
    parser: argparse.ArgumentParser, base: LockstepConfig, a: argparse.Namespace
) -> LockstepConfig:
    """The resolved config `lockstep serve` runs and hands to its children."""
    cfg = config.resolve(parser, base, a, "serve")
    data_dir = cfg.data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    vision = bool(getattr(a, "vision", False))  # only the demo has --vision
    model_dir, names = resolve_models(list(cfg.model.specs), data_dir, vision)
    keys_file = cfg.gateway.keys_file
    env_keys = [k for k in os.environ.get("LOCKSTEP_API_KEYS", "").split(",") if k.strip()]
    return replace_paths(
        cfg,
        {
            ("data_dir",): data_dir,
            ("model", "dir"): model_dir,
            ("model", "served_names"): names,
            ("gateway", "api_keys"): (*cfg.gateway.api_keys, *env_keys),
            ("gateway", "keys_file"): keys_file.expanduser().resolve() if keys_file else None,
        },
    )


def build_parser(
    base: LockstepConfig | None = None,
) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The `lockstep` parser and its subcommands' parsers."""
    base = base or LockstepConfig()
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=f"lockstep {VERSION} (state format {STATE_FORMAT})",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Tinker-compatible training service")
    add_serve_args(serve, base)
    demo = sub.add_parser(
        "demo",
        help="start the service and train several LoRA tenants at once through the tinker SDK "
        "(Pig Latin SFT, an RL loop, a second SFT), showing how they share clock cycles",
    )
    add_serve_args(demo, base)
    demo.add_argument(
        "--steps",
        type=int,
        default=12,
        help="steps each tenant takes together with the others, and as many one after another "
        "(the baseline; the two ways take turns)",
    )
    demo.add_argument("--tenants", type=int, default=3, help="tenants training at once")
    demo.add_argument("--summary-json", type=Path, help="also write the summary here")
    demo.add_argument(
        "--stay",
        action="store_true",
        help="keep serving after the summary (the console keeps the demo's runs, checkpoints "
        "and curves) until Ctrl-C or SIGTERM, as `lockstep serve` does",
    )
    demo.add_argument(
        "--vision",
        action="store_true",
        help="serve a tiny vision-language model (unless --model names one) and add a tenant "
        "that learns to name the colour of an image",
    )
    admin = sub.add_parser("admin", help="per-key usage, audit log and keys (operators)")
    admin_mod.add_arguments(admin, config.DEFAULT_DATA_DIR)
    return parser, {"serve": serve, "demo": demo}


def main(argv: list[str] | None = None) -> None:
    base = config.base_config(argv)
    parser, commands = build_parser(base)
    a = parser.parse_args(argv)
    if a.command == "admin":
        sys.exit(admin_mod.main(a))
    logging.basicConfig(
        level=a.log_level.upper(), format="%(asctime)s %(levelname)s [lockstep] %(message)s"
    )
    cfg = serve_config(commands[a.command], base, a)
    if a.command == "serve":
        sys.exit(run(cfg))
    from lockstep.demo import run_demo

    if min(a.steps, a.tenants) < 1:
        parser.error("--steps and --tenants must be at least 1")
    sys.exit(run_demo(cfg, a.steps, a.tenants, a.summary_json, a.vision, a.stay))


if __name__ == "__main__":
    main()
