"""`python -m lockstep.gateway --scheduler ADDR [--host H] [--port P] ...`"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

from lockstep.gateway.app import run_gateway
from lockstep.gateway.settings import GatewaySettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lockstep.gateway",
        description="Serve the Tinker HTTP API in front of a Lockstep scheduler.",
    )
    p.add_argument("--scheduler", required=True, help="gRPC address of the scheduler, host:port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--api-key", action="append", default=[], help="accepted API key (repeatable)")
    p.add_argument(
        "--api-keys-file",
        type=Path,
        help="file with accepted API keys, one per line ('#' comments)",
    )
    p.add_argument(
        "--allow-any-tml-key",
        action="store_true",
        help="with no keys configured, accept any key starting with 'tml-'",
    )
    p.add_argument(
        "--file-url-secret-file", type=Path, help="file holding the download-URL signing secret"
    )
    p.add_argument("--public-base-url", help="base URL clients use to reach this gateway")
    p.add_argument(
        "--long-poll-seconds", type=float, default=25.0, help="retrieve_future wait (default 25)"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=256 * 1024 * 1024, help="largest request body"
    )
    p.add_argument(
        "--max-datums-per-request", type=int, default=4096,
        help="the scheduler's datum limit; the SDK is told to chunk below it",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    keys = set(args.api_key)
    if args.api_keys_file is not None:
        for line in args.api_keys_file.read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    secret = b""
    if args.file_url_secret_file is not None:
        secret = args.file_url_secret_file.read_bytes().strip()
        if not secret:
            raise SystemExit(f"{args.file_url_secret_file} is empty")
    return GatewaySettings(
        scheduler_address=args.scheduler,
        api_keys=frozenset(keys),
        allow_any_tml_key=args.allow_any_tml_key,
        long_poll_seconds=args.long_poll_seconds,
        max_body_bytes=args.max_body_bytes,
        max_datums_per_request=args.max_datums_per_request,
        file_url_secret=secret,
        public_base_url=args.public_base_url,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    run_gateway(settings, args.host, args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
