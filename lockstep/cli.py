"""The `lockstep` command: `serve` runs the service, `demo` shows it training."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from lockstep import limits
from lockstep.rollout import config as rollout_config
from lockstep.supervisor import ServeConfig, run
from lockstep.workers.megatron import options as engine_options

DEFAULT_DATA_DIR = Path(os.path.expanduser("~/.lockstep"))


def resolve_models(specs: list[str], data_dir: Path) -> tuple[Path, tuple[str, ...]]:
    """`--model` values -> (the one local model directory, the names it is served under).

    A value is `DIR` (served under its path) or `NAME=DIR` (an alias, e.g. a hub name a recipe
    insists on). With none, the built-in tiny Qwen3 model is built (once) under the data dir.
    """
    from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model

    if not specs:
        return ensure_default_model(data_dir / "models"), (DEFAULT_MODEL_NAME,)
    directory: Path | None = None
    names: list[str] = []
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        local = Path(path).expanduser().resolve()
        if not (local / "config.json").is_file():
            raise SystemExit(f"--model {spec}: {local} is not a local Hugging Face model "
                             "directory (config.json missing); downloads are not supported")
        if directory is not None and local != directory:
            raise SystemExit("--model: all names must point to the same directory "
                             "(one base model is shared by every tenant)")
        directory = local
        names.append(name or str(local))
    assert directory is not None
    return directory, tuple(dict.fromkeys(names))


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API binds to")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR,
                   help="checkpoints, Redis append-only files and built models")
    p.add_argument("--model", action="append", default=[], metavar="[NAME=]DIR",
                   help="local HF model directory to serve, optionally under NAME; repeatable")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis instead of starting the embedded one")
    p.add_argument("--api-key", action="append", default=[],
                   help="accepted API key (repeatable; also LOCKSTEP_API_KEYS, comma-separated)")
    p.add_argument("--clock-policy", choices=["triggered", "periodic"], default="triggered",
                   help="triggered: a cycle starts when work arrives; periodic: every period")
    p.add_argument("--clock-period", type=float, default=1.0, help="seconds (periodic policy)")
    p.add_argument("--clock-gather", type=float, default=0.02,
                   help="seconds to gather requests before a triggered cycle")
    p.add_argument("--token-budget", type=int, default=65536,
                   help="pass tokens packed into one cycle")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="port of the scheduler's /metrics (default: a free port, logged); the "
                   "gateway serves its own /metrics on --port")
    p.add_argument("--metrics-max-tenants", type=int, default=32,
                   help="API-key owners with per-tenant metric series of their own (the rest "
                   "are counted as owner=\"other\")")
    limits.add_serve_arguments(p)
    rollout_config.add_arguments(p)
    engine_options.add_arguments(p)
    p.add_argument("--log-level", default="info")


def serve_config(a: argparse.Namespace) -> ServeConfig:
    data_dir = a.data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    model_dir, names = resolve_models(a.model, data_dir)
    keys = list(a.api_key)
    keys += [k for k in os.environ.get("LOCKSTEP_API_KEYS", "").split(",") if k.strip()]
    try:
        lim = limits.from_serve_args(a)
    except ValueError as exc:
        raise SystemExit(f"lockstep serve: {exc}") from exc
    try:
        sampler = rollout_config.from_args(a)
    except ValueError as exc:
        raise SystemExit(f"lockstep serve: {exc}") from exc
    try:
        engine = engine_options.from_args(a)
    except ValueError as exc:
        raise SystemExit(f"lockstep serve: {exc}") from exc
    # The limits reach the scheduler beside the clock flags, the gateway as its own flags.
    clock = ("--clock-policy", a.clock_policy, "--clock-period", str(a.clock_period),
             "--clock-gather", str(a.clock_gather), "--token-budget", str(a.token_budget),
             *lim.scheduler_argv(), *sampler.argv(), *engine.argv())
    gateway = ("--max-body-bytes", str(lim.max_body_bytes),
               "--max-datums-per-request", str(lim.max_datums_per_request))
    return ServeConfig(host=a.host, port=a.port, data_dir=data_dir, model_dir=model_dir,
                       served_names=names, redis_url=a.redis_url, api_keys=tuple(keys),
                       clock_args=clock, gateway_args=gateway, log_level=a.log_level,
                       metrics_port=a.metrics_port,
                       metrics_max_tenants=a.metrics_max_tenants)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lockstep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the Tinker-compatible training service")
    add_serve_args(serve)
    demo = sub.add_parser("demo", help="start the service and train a LoRA adapter through the "
                          "tinker SDK (Pig Latin quickstart)")
    add_serve_args(demo)
    demo.add_argument("--steps", type=int, default=30)
    a = parser.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s [lockstep] %(message)s")
    if a.command == "serve":
        sys.exit(run(serve_config(a)))
    from lockstep.demo import run_demo

    sys.exit(run_demo(serve_config(a), a.steps))


if __name__ == "__main__":
    main()
