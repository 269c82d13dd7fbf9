"""Gateway settings: what the running gateway holds, built from the root config
(`lockstep.gateway.__main__.settings_from_config`), whose defaults it shares."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from pathlib import Path

from lockstep.config import GatewayConfig, Limits
from lockstep.config.sections import FwdbwdCompression

# The SDK's retrieve_future client timeout is 45 s; a long-poll must answer well before it.
MAX_LONG_POLL_SECONDS = 40.0
_CONFIG = GatewayConfig()
_LIMITS = Limits()


def compress_fwdbwd(choice: FwdbwdCompression, host: str) -> bool:
    """Whether the SDK is told to zstd-compress its fwd/bwd bodies. Auto: on unless the API
    binds a loopback address (there the bytes never cross a network, and compressing a large
    batch costs the client seconds of CPU)."""
    if choice != "auto":
        return choice == "on"
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: reachable from elsewhere
        return True


@dataclass(frozen=True)
class GatewaySettings:
    """Everything the HTTP gateway needs to know; nothing is read from the environment.

    Attributes:
        scheduler_address: gRPC target of the scheduler, e.g. "127.0.0.1:50051".
        api_keys: accepted `X-API-Key` values. Empty means "no fixed list" (see below).
        allow_any_tml_key: with an empty `api_keys`, accept any key starting with "tml-"
            (single-user / development deployments). Ignored when `api_keys` is non-empty.
        long_poll_seconds: how long one `retrieve_future` call waits for a result before it
            answers `try_again`. Must stay under the SDK's 45 s client timeout.
        max_body_bytes: largest accepted request body, after decompression (413 above it).
        max_datums_per_request: the scheduler's datum limit per fwd/bwd request
            (lockstep.config.Limits); the client config tells the SDK to chunk below it.
        file_url_secret: HMAC key that signs the checkpoint download URLs this gateway hands
            out (`external_weights_urls`) and later serves (`/api/v1/checkpoint_files/...`).
        public_base_url: base URL clients reach this gateway at (e.g. behind a proxy), used to
            build download URLs. None: derived from each request's own URL.
        file_url_ttl_seconds: lifetime of a signed download URL.
        grpc_max_message_bytes: max gRPC message size in both directions (fwd/bwd requests
            and their outputs can be far larger than gRPC's 4 MiB default).
        tokenizer_dir: the served model's directory (its tokenizer and chat template), for the
            OpenAI- and Anthropic-compatible routes, which take and return text. None: those
            routes answer 404 for every model.
        keys_file: named keys with quotas (lockstep/keyring.py), re-read on SIGHUP.
        proto_compress_fwdbwd: tell the SDK to zstd-compress its protobuf fwd/bwd bodies
            (`compress_fwdbwd` decides it from the config); any body may be compressed anyway.
        sample_session_polling: tell the SDK to wait for samples with one poller per sampling
            session (`/api/v1/retrieve_futures`) instead of a long-poll per sample.
        admin_keys: keys accepted like any other that also read every key's runs,
            checkpoints and usage (`access_scope=accessible`; the console).
        scheduler_metrics_url: the scheduler's Prometheus endpoint, whose clock figures the
            console shows. None: no clock in the console.
    """

    scheduler_address: str
    api_keys: frozenset[str] = frozenset()
    allow_any_tml_key: bool = False
    long_poll_seconds: float = _CONFIG.long_poll_seconds
    max_body_bytes: int = _LIMITS.max_body_bytes
    max_datums_per_request: int = _LIMITS.max_datums_per_request
    file_url_secret: bytes = b""
    public_base_url: str | None = None
    file_url_ttl_seconds: int = 3600
    grpc_max_message_bytes: int = 512 * 1024 * 1024
    tokenizer_dir: Path | None = None
    keys_file: Path | None = None
    proto_compress_fwdbwd: bool = False
    sample_session_polling: bool = True
    admin_keys: frozenset[str] = frozenset()
    scheduler_metrics_url: str | None = None

    def __post_init__(self) -> None:
        if not self.scheduler_address:
            raise ValueError("scheduler_address must not be empty")
        if not (
            math.isfinite(self.long_poll_seconds)
            and 0 < self.long_poll_seconds <= MAX_LONG_POLL_SECONDS
        ):
            raise ValueError(
                f"long_poll_seconds must be in (0, {MAX_LONG_POLL_SECONDS}], "
                f"got {self.long_poll_seconds}"
            )
        if self.max_body_bytes <= 0:
            raise ValueError("max_body_bytes must be > 0")
        if self.max_datums_per_request <= 0:
            raise ValueError("max_datums_per_request must be > 0")
        if self.file_url_ttl_seconds <= 0:
            raise ValueError("file_url_ttl_seconds must be > 0")
        if self.public_base_url is not None and not self.public_base_url.startswith(
            ("http://", "https://")
        ):
            raise ValueError("public_base_url must start with http:// or https://")
