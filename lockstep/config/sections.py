"""The sections of the root config (lockstep.config.LockstepConfig), one frozen dataclass each:
clock, sampler, metrics, model, gateway and the scheduler process's wiring (the training engine's
is `training.py`, the limits' `limits.py`, tenancy's `tenancy.py`).

Each flagged field is the one declaration of its setting: the flag, its help, its default and
which command lines have it (see lockstep.config.flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lockstep.config.flags import (
    GATEWAY,
    GATEWAY_ONLY,
    SCHEDULER,
    SCHEDULER_ONLY,
    SERVE,
    flag,
)

SamplerKind = Literal["local", "vllm", "sglang"]
# The local sampler's weights (auto: bfloat16 on CUDA, float32 elsewhere) and decode step
# (static: a fixed-capacity KV cache per batch, replayed as CUDA graphs on CUDA).
SamplerDtype = Literal["auto", "float32", "bfloat16"]
SamplerDecode = Literal["eager", "static"]
TRACE_RETENTION_S = 7 * 24 * 3600
MIB = 1024 * 1024
GIB = 1024 * MIB
LogLevel = Literal["debug", "info", "warning", "error"]
# Whether the SDK zstd-compresses its fwd/bwd bodies; auto: unless the gateway binds loopback
# (lockstep.gateway.settings.compress_fwdbwd decides).
FwdbwdCompression = Literal["auto", "on", "off"]
# How SDK SamplingClients wait for their samples: one session poller on retrieve_futures, or a
# retrieve_future long-poll per sample.
SamplePolling = Literal["session", "per-request"]
# How `lockstep serve`'s gateway reaches its scheduler on the same host: a Unix socket in the
# data dir (no TCP stack on every request), or loopback TCP.
SchedulerTransport = Literal["unix", "tcp"]


@dataclass(frozen=True)
class ClockConfig:
    """How cycles are started.

    policy "triggered": a cycle starts `gather_s` after work arrives and runs everything ready.
    policy "periodic":  a cycle starts every `period_s` whether or not there is work (the
                        counter advances on idle cycles too, as hosted Tinker's does).
    """

    policy: Literal["triggered", "periodic"] = field(
        default="triggered",
        metadata=flag(
            "--clock-policy",
            help="triggered: a cycle starts when work arrives; periodic: every period",
            on=SCHEDULER,
        ),
    )
    period_s: float = field(
        default=1.0,
        metadata=flag("--clock-period", help="seconds (periodic policy)", on=SCHEDULER),
    )
    gather_s: float = field(
        default=0.02,
        metadata=flag(
            "--clock-gather",
            help="seconds to gather requests before a triggered cycle",
            on=SCHEDULER,
        ),
    )
    token_budget: int = field(
        default=65536,
        metadata=flag(
            "--token-budget",
            help="most pass tokens one fused pass may hold (a memory bound)",
            on=SCHEDULER,
        ),
    )
    # Light tenants wait for whole cycles, so a cycle's length bounds their latency beside a
    # heavy tenant (scheduler.cycle.pace turns it into tokens from the measured engine rate).
    cycle_target_s: float = field(
        default=0.05,
        metadata=flag(
            "--cycle-target",
            help="seconds of pass work one tenant may add to a shared cycle, beyond its fixed "
            "costs: no tenant packs more than the tokens the engine gets through in that time "
            "at its measured per-token cost (or the next-largest tenant's ready passes), so a "
            "heavy tenant's excess waits for later cycles; 0 = always pack up to --token-budget",
            on=SCHEDULER,
        ),
    )


@dataclass(frozen=True)
class SamplerConfig:
    """Which sampling engine the scheduler runs (rollout.config.start_sampler builds it)."""

    kind: SamplerKind = field(
        default="local",
        metadata=flag(
            "--sampler",
            help="local: the built-in torch sampler; vllm / sglang: start and supervise that "
            "server (or attach with --sampler-url)",
            on=SCHEDULER,
        ),
    )
    url: str | None = field(
        default=None,
        metadata=flag(
            "--sampler-url",
            help="attach to a running vLLM / SGLang server instead of starting one",
            on=SCHEDULER,
            metavar="URL",
        ),
    )
    max_adapters: int | None = field(
        default=None,
        metadata=flag(
            "--max-adapters",
            help="LoRA adapters resident in the sampler at once; the least recently used is "
            "evicted and reloaded on demand (default: 64 local, 4 vllm/sglang)",
            on=SCHEDULER,
        ),
    )
    colocate: bool = field(
        default=False,
        metadata=flag(
            "--colocate",
            help="trainer and sampler share one accelerator: the sampler releases its memory "
            "before each training phase and resumes after it",
            on=SCHEDULER,
        ),
    )
    vllm_python: Path | None = field(
        default=None,
        metadata=flag(
            "--vllm-python",
            help="python of a venv with vllm (default: build/reuse ~/.cache/lockstep-vllm-venv-*)",
            on=SCHEDULER,
        ),
    )
    sglang_python: Path | None = field(
        default=None,
        metadata=flag(
            "--sglang-python",
            help="python of a venv with sglang (default: this python)",
            on=SCHEDULER,
        ),
    )
    slice_steps: int = field(
        default=8,
        metadata=flag(
            "--sample-slice-steps",
            help="decode steps of each local sampler call: samples queued meanwhile start at "
            "the next call, so a long generation delays a short one by about a slice, not its "
            "whole length (vLLM and SGLang run each batch whole)",
            on=SCHEDULER,
        ),
    )
    dtype: SamplerDtype = field(
        default="auto",
        metadata=flag(
            "--sampler-dtype",
            help="base-weight dtype of the local sampler (auto: bfloat16 on CUDA, float32 on "
            "CPU); adapters run in float32 as in the trainer, logprobs come from float32 logits",
            on=SCHEDULER,
        ),
    )
    decode: SamplerDecode = field(
        default="eager",
        metadata=flag(
            "--sampler-decode",
            help="decode step of the local sampler: eager (a growing KV cache) or static (a "
            "fixed-capacity KV cache per batch, captured as CUDA graphs on CUDA); models "
            "whose cache is not plain full attention decode eagerly and say so at start",
            on=SCHEDULER,
        ),
    )
    max_lora_rank: int = field(
        default=64,
        metadata=flag(
            "--max-lora-rank",
            help="largest adapter rank the vLLM / SGLang server accepts (with those samplers, "
            "also the largest rank a training run may ask for)",
            on=SCHEDULER,
        ),
    )

    def __post_init__(self) -> None:
        if self.max_adapters is not None and self.max_adapters < 1:
            raise ValueError(f"--max-adapters must be >= 1, got {self.max_adapters}")
        if self.slice_steps < 1:
            raise ValueError(f"--sample-slice-steps must be >= 1, got {self.slice_steps}")
        if self.url is not None and self.kind == "local":
            raise ValueError(
                "--sampler-url needs --sampler vllm or --sampler sglang (the API the server speaks)"
            )

    @property
    def resident_adapters(self) -> int:
        """--max-adapters, or its default for this kind of sampler."""
        if self.max_adapters is not None:
            return self.max_adapters
        return 64 if self.kind == "local" else 4


@dataclass(frozen=True)
class MetricsConfig:
    """The scheduler's ops server (/metrics, /healthz, /livez); the gateway's /metrics is on
    its API port."""

    host: str = field(
        default="127.0.0.1",
        metadata=flag(
            "--metrics-host",
            help="address of the scheduler's /metrics, /healthz and /livez server",
            on=SCHEDULER_ONLY,
        ),
    )
    port: int | None = field(
        default=None,
        metadata=flag(
            "--metrics-port",
            help="port of the scheduler's /metrics, /healthz and /livez (0: any free port, "
            "logged; omitted: `lockstep serve` picks a free port, the scheduler alone serves "
            "none)",
            on=SCHEDULER,
        ),
    )
    trace_retention_s: int = field(
        default=TRACE_RETENTION_S,
        metadata=flag(
            "--trace-retention",
            help="seconds a session's trace (RestClient.export_session_trace) is kept; 0: none",
            on=SCHEDULER,
        ),
    )
    max_tenants: int = field(
        default=32,
        metadata=flag(
            "--metrics-max-tenants",
            help="API-key owners with per-tenant metric series of their own (the rest are "
            'counted as owner="other")',
            on=SCHEDULER,
        ),
    )


@dataclass(frozen=True)
class ModelConfig:
    """The one base model every tenant shares, and the names it is served under."""

    specs: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--model",
            help="local HF model directory to serve, optionally under NAME; repeatable "
            "(default: the built-in tiny Qwen3 model)",
            on=SERVE,
            metavar="[NAME=]DIR",
        ),
    )
    dir: Path | None = field(
        default=None,
        metadata=flag(
            "--model-dir",
            help="local HF model directory",
            on=SCHEDULER_ONLY,
            required=SCHEDULER_ONLY,
        ),
    )
    served_names: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--served-name",
            help="a name the model is served under; repeatable",
            on=SCHEDULER_ONLY,
            required=SCHEDULER_ONLY,
        ),
    )
    image_dir: Path | None = field(
        default=None,
        metadata=flag(
            "--image-dir",
            help="local directory whose files image_asset_pointer chunks may name (default: "
            "none; such chunks are refused, and URLs always are)",
            on=SCHEDULER,
        ),
    )


@dataclass(frozen=True)
class GatewayConfig:
    """The HTTP gateway (`lockstep.gateway.settings.GatewaySettings` is built from it)."""

    host: str = field(
        default="127.0.0.1",
        metadata=flag("--host", help="address the HTTP API binds to", on=GATEWAY),
    )
    port: int = field(default=8000, metadata=flag("--port", help="HTTP API port", on=GATEWAY))
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--api-key",
            help="accepted API key (repeatable; `lockstep serve` also reads LOCKSTEP_API_KEYS, "
            "comma-separated)",
            on=GATEWAY,
        ),
    )
    admin_keys: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "--admin-key",
            help="an API key that is accepted like any other and also sees every key's runs, "
            "checkpoints and usage, read only (the console; access_scope=accessible); "
            "repeatable (a keys file marks its own with admin = true)",
            on=GATEWAY,
        ),
    )
    api_keys_file: Path | None = field(
        default=None,
        metadata=flag(
            "--api-keys-file",
            help="file with accepted API keys, one per line ('#' comments)",
            on=GATEWAY_ONLY,
        ),
    )
    allow_any_tml_key: bool = field(
        default=False,
        metadata=flag(
            "--allow-any-tml-key",
            help="with no keys configured, accept any key starting with 'tml-'",
            on=GATEWAY_ONLY,
        ),
    )
    file_url_secret_file: Path | None = field(
        default=None,
        metadata=flag(
            "--file-url-secret-file",
            help="file holding the download-URL signing secret",
            on=GATEWAY_ONLY,
        ),
    )
    public_base_url: str | None = field(
        default=None,
        metadata=flag(
            "--public-base-url",
            help="base URL clients use to reach this gateway",
            on=GATEWAY_ONLY,
        ),
    )
    keys_file: Path | None = field(
        default=None,
        metadata=flag(
            "--keys-file",
            help="TOML of named API keys with optional quotas; re-read on SIGHUP "
            "(docs/operations.md)",
            on=GATEWAY,
        ),
    )
    tokenizer_dir: Path | None = field(
        default=None,
        metadata=flag(
            "--tokenizer-dir",
            help="the served model's directory (tokenizer, chat template) for /oai and /anthropic",
            on=GATEWAY_ONLY,
        ),
    )
    fwdbwd_compression: FwdbwdCompression = field(
        default="auto",
        metadata=flag(
            "--fwdbwd-compression",
            help="have the SDK zstd-compress its forward_backward bodies (auto: on unless the "
            "API binds a loopback address)",
            on=GATEWAY,
        ),
    )
    sample_polling: SamplePolling = field(
        default="session",
        metadata=flag(
            "--sample-polling",
            help="how SDK sampling clients wait for results: one poller per sampling session "
            "(/api/v1/retrieve_futures) or one long-poll per sample",
            on=GATEWAY,
        ),
    )
    long_poll_seconds: float = field(
        default=25.0,
        metadata=flag(
            "--long-poll-seconds",
            help="how long one retrieve_future call waits before answering try_again",
            on=GATEWAY_ONLY,
        ),
    )
    scheduler_metrics_url: str | None = field(
        default=None,
        metadata=flag(
            "--scheduler-metrics-url",
            help="the scheduler's Prometheus /metrics URL, whose clock figures the console "
            "shows (`lockstep serve` sets it; none: the console shows no clock)",
            on=GATEWAY_ONLY,
            metavar="URL",
        ),
    )
    scheduler_address: str | None = field(
        default=None,
        metadata=flag(
            "--scheduler",
            help="gRPC address of the scheduler, host:port",
            on=GATEWAY_ONLY,
            required=GATEWAY_ONLY,
        ),
    )


@dataclass(frozen=True)
class SchedulerProcessConfig:
    """Where the scheduler process listens and which Redis it uses."""

    listen: str | None = field(
        default=None,
        metadata=flag(
            "--listen",
            help='gRPC address, e.g. "127.0.0.1:50051" or "unix:/path/sock"',
            on=SCHEDULER_ONLY,
            required=SCHEDULER_ONLY,
        ),
    )
    redis_url: str | None = field(
        default=None,
        metadata=flag(
            "--redis-url",
            help="Redis to use (`lockstep serve` without it starts the embedded one)",
            on=SCHEDULER,
            required=SCHEDULER_ONLY,
        ),
    )
    redis_max_memory: int = field(
        default=4 * GIB,
        metadata=flag(
            "--redis-maxmemory",
            help="bytes the embedded Redis may hold (its maxmemory, with maxmemory-policy "
            "noeviction: a full Redis refuses writes and never drops a future); past 90 % of "
            "it new work gets a 429 (retried by the SDK) until results expire. 0: no limit",
            on=SERVE,
            scaled=(("--redis-maxmemory-mb", MIB, "the same limit in MiB"),),
        ),
    )
    transport: SchedulerTransport = field(
        default="unix",
        metadata=flag(
            "--scheduler-transport",
            help="how the gateway reaches the scheduler on this host: a Unix socket in the "
            "data dir, or loopback TCP",
            on=SERVE,
        ),
    )
    max_sample_batch: int = 64  # sample requests in one sampling engine batch

    def __post_init__(self) -> None:
        if self.redis_max_memory < 0:
            raise ValueError(f"--redis-maxmemory must be >= 0, got {self.redis_max_memory}")
