"""`python -m lockstep.gateway --scheduler ADDR [--host H] [--port P] ...` or `--config FILE`.

The flags are generated from the root config (lockstep/config); `lockstep serve` starts the
gateway with `--config FILE` only.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from lockstep import config
from lockstep.config import LockstepConfig
from lockstep.gateway.app import run_gateway
from lockstep.gateway.settings import GatewaySettings, compress_fwdbwd


def build_parser(base: LockstepConfig | None = None) -> argparse.ArgumentParser:
    return config.build_parser(
        "gateway",
        base or LockstepConfig(),
        prog="python -m lockstep.gateway",
        description="Serve the Tinker HTTP API in front of a Lockstep scheduler.",
    )


def settings_from_config(cfg: LockstepConfig) -> GatewaySettings:
    """The gateway's settings; reads the key file and the URL-signing secret file."""
    g = cfg.gateway
    keys = set(g.api_keys)
    if g.api_keys_file is not None:
        for line in g.api_keys_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    secret = b""
    if g.file_url_secret_file is not None:
        secret = g.file_url_secret_file.read_bytes().strip()
        if not secret:
            raise SystemExit(f"{g.file_url_secret_file} is empty")
    assert g.scheduler_address is not None  # a required flag (lockstep.config.sections)
    return GatewaySettings(
        scheduler_address=g.scheduler_address,
        api_keys=frozenset(keys),
        allow_any_tml_key=g.allow_any_tml_key,
        long_poll_seconds=g.long_poll_seconds,
        max_body_bytes=cfg.limits.max_body_bytes,
        max_datums_per_request=cfg.limits.max_datums_per_request,
        file_url_secret=secret,
        public_base_url=g.public_base_url,
        tokenizer_dir=g.tokenizer_dir,
        keys_file=g.keys_file,
        proto_compress_fwdbwd=compress_fwdbwd(g.fwdbwd_compression, g.host),
        sample_session_polling=g.sample_polling == "session",
        admin_keys=frozenset(g.admin_keys),
        scheduler_metrics_url=g.scheduler_metrics_url,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = list(argv) if argv is not None else None
    base = config.base_config(args)
    parser = build_parser(base)
    cfg = config.resolve(parser, base, parser.parse_args(args), "gateway")
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_config(cfg)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    run_gateway(settings, cfg.gateway.host, cfg.gateway.port, log_level=cfg.log_level)


if __name__ == "__main__":
    main()
