"""The sections of the root config (lockstep.config.LockstepConfig), one frozen dataclass each.

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
EngineKind = Literal["local", "megatron"]
# Ray placement-group strategy for the megatron ranks (one bundle per rank): PACK as few nodes as
# possible (TP ranks share a node's links), SPREAD across nodes, STRICT_* or fail.
RayPlacement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
DtypeName = Literal["float32", "bfloat16"]  # lockstep.engine.types.Dtype
# A 4096-token micro-batch of SmolLM2-135M keeps ~7.5 GB of fp32 activations; 1024 fits a CPU box.
DEFAULT_MICRO_BATCH_TOKENS = 1024
# Snapshots cost I/O per tenant (a Qwen3-8B rank-32 adapter + Adam moments is ~1 GB); the replay
# log covers the steps between them, so a restart recomputes at most this much of a run's work.
DEFAULT_SNAPSHOT_INTERVAL_S = 10.0
TRACE_RETENTION_S = 7 * 24 * 3600
LogLevel = Literal["debug", "info", "warning", "error"]
# Whether the SDK zstd-compresses its fwd/bwd bodies; auto: unless the gateway binds loopback
# (lockstep.gateway.settings.compress_fwdbwd decides).
FwdbwdCompression = Literal["auto", "on", "off"]
# How SDK SamplingClients wait for their samples: one session poller on retrieve_futures, or a
# retrieve_future long-poll per sample.
SamplePolling = Literal["session", "per-request"]
TE_MISSING = (
    "needs NVIDIA Transformer Engine, which is not installed: megatron-core runs context "
    "parallel only in TEDotProductAttention and sequence parallel only with TE norms/linears"
)


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
class ParallelConfig:
    """How many ranks split each axis of a Megatron worker group."""

    tp: int = field(  # splits heads, MLP columns and the vocabulary
        default=1,
        metadata=flag("--tp", help="tensor parallel size (--engine megatron)", on=SCHEDULER),
    )
    pp: int = field(  # splits the layers into stages
        default=1,
        metadata=flag("--pp", help="pipeline parallel size (--engine megatron)", on=SCHEDULER),
    )
    cp: int = field(  # splits the sequence (Transformer Engine only)
        default=1,
        metadata=flag("--cp", help="context parallel size (--engine megatron)", on=SCHEDULER),
    )
    dp: int = field(  # splits the rows of a cycle's batch
        default=1,
        metadata=flag("--dp", help="data parallel size (--engine megatron)", on=SCHEDULER),
    )
    ep: int = field(  # splits the experts of MoE layers (carved out of tp x dp, as megatron does)
        default=1,
        metadata=flag(
            "--ep", help="expert parallel size (--engine megatron, MoE models)", on=SCHEDULER
        ),
    )
    sequence_parallel: bool = field(
        default=False,
        metadata=flag(
            "--sequence-parallel",
            help="megatron sequence parallel (needs Transformer Engine)",
            on=SCHEDULER,
        ),
    )

    def __post_init__(self) -> None:
        axes = (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("dp", self.dp), ("ep", self.ep))
        for axis, value in axes:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{axis} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def check_model(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        vocab: int,
        intermediate: int,
        experts: int = 0,
    ) -> None:
        """Refuse splits the model cannot take, naming the flag."""
        if self.ep > 1 and not experts:
            raise ValueError(f"--ep {self.ep} needs a mixture-of-experts model")
        if experts and experts % self.ep:
            raise ValueError(f"--ep {self.ep} must divide the model's {experts} experts")
        if (self.tp * self.dp) % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide --tp x --dp ({self.tp * self.dp}): expert ranks "
                "are carved out of the tensor and data parallel ranks"
            )
        if num_layers % self.pp:
            raise ValueError(f"--pp {self.pp} must divide the model's {num_layers} layers")
        for what, n in (
            ("attention heads", num_heads),
            ("key/value heads", num_kv_heads),
            ("vocabulary entries", vocab),
            ("MLP columns", intermediate),
        ):
            if n % self.tp:
                raise ValueError(f"--tp {self.tp} must divide the model's {n} {what}")

    def check_backend(self) -> None:
        """cp > 1 and sequence parallel need Transformer Engine: fail at startup, clearly."""
        wanted = [
            flag
            for flag, on in (("--cp", self.cp > 1), ("--sequence-parallel", self.sequence_parallel))
            if on
        ]
        if wanted and not has_transformer_engine():
            raise ValueError(f"{' and '.join(wanted)} {TE_MISSING}")


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class EngineConfig:
    """The training engine: one local torch process, or Megatron-core ranks on Ray."""

    kind: EngineKind = field(
        default="local",
        metadata=flag(
            "--engine",
            help="local: one torch process; megatron: megatron-core ranks on Ray",
            on=SCHEDULER,
        ),
    )
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ray_address: str | None = field(
        default=None,
        metadata=flag(
            "--ray-address",
            help="Ray cluster for the megatron ranks (default: a local Ray runtime)",
            on=SCHEDULER,
        ),
    )
    micro_batch: int = field(
        default=8,
        metadata=flag(
            "--micro-batch",
            help="rows per pipeline micro-batch (--engine megatron)",
            on=SCHEDULER,
        ),
    )
    micro_batch_tokens: int = field(
        default=DEFAULT_MICRO_BATCH_TOKENS,
        metadata=flag(
            "--micro-batch-tokens",
            help="tokens per training micro-batch: rows are sorted by length, cut under this "
            "budget and packed into one sequence, each padded only to a multiple of 8 "
            "(--engine local)",
            on=SCHEDULER,
        ),
    )
    memory_budget_bytes: int = field(
        default=0,
        metadata=flag(
            "--trainer-memory-budget",
            help="bytes one training pass may use; datums whose pass would not fit are refused "
            "at submission (400). 0: on CUDA the free device memory after load minus 10%, on "
            "CPU 75% of the available RAM (or of the room under the trainer's RLIMIT_AS)",
            on=SCHEDULER,
            metavar="BYTES",
            scaled=(("--trainer-memory-budget-gib", 1 << 30, "the same budget in GiB"),),
        ),
    )
    snapshot_interval_s: float = field(
        default=DEFAULT_SNAPSHOT_INTERVAL_S,
        metadata=flag(
            "--snapshot-interval",
            help="seconds between background snapshots of a training run's adapter and Adam "
            "state (taken at an optim_step; 0: every step). A restart or a page-in replays the "
            "steps since the last one; with --max-resident-models every step is snapshotted",
            on=SCHEDULER,
        ),
    )
    dtype: DtypeName | None = field(
        default=None,
        metadata=flag(
            "--dtype",
            help="base-weight dtype of the local trainer (default: float32 on CPU, bfloat16 on "
            "CUDA; adapters and Adam state stay float32)",
            on=SCHEDULER,
        ),
    )
    activation_checkpointing: bool = field(
        default=False,
        metadata=flag(
            "--activation-checkpointing",
            help="recompute decoder layers in backward instead of keeping their activations, "
            "and on CPU return freed activation memory to the OS (--engine local)",
            on=SCHEDULER,
        ),
    )
    deadline_s: float = field(
        default=600.0,
        metadata=flag(
            "--engine-deadline",
            help="seconds any call of the local trainer or sampler process may take, plus "
            "--engine-deadline-per-token for each token it carries; past it the engine is "
            "declared wedged, killed and restarted (a request that keeps killing it is refused). "
            "0: no deadline",
            on=SCHEDULER,
        ),
    )
    deadline_per_token_s: float = field(
        default=0.05,
        metadata=flag(
            "--engine-deadline-per-token",
            help="seconds added to a call's deadline per token it carries (see --engine-deadline)",
            on=SCHEDULER,
        ),
    )
    ray_placement: RayPlacement = field(
        default="PACK",
        metadata=flag(
            "--ray-placement",
            help="how the megatron ranks are placed on the Ray cluster's nodes",
            on=SCHEDULER,
        ),
    )

    def __post_init__(self) -> None:
        p = self.parallel
        if self.kind == "local" and (p.world_size > 1 or p.sequence_parallel):
            raise ValueError("--tp/--pp/--cp/--dp/--sequence-parallel need --engine megatron")
        if self.micro_batch < 1:
            raise ValueError(f"--micro-batch must be >= 1, got {self.micro_batch}")
        if self.micro_batch_tokens < 1:
            raise ValueError(f"--micro-batch-tokens must be >= 1, got {self.micro_batch_tokens}")
        if self.memory_budget_bytes < 0:
            raise ValueError(
                f"--trainer-memory-budget must be >= 0, got {self.memory_budget_bytes}"
            )
        if self.snapshot_interval_s < 0:
            raise ValueError(f"--snapshot-interval must be >= 0, got {self.snapshot_interval_s}")
        if self.deadline_s < 0 or self.deadline_per_token_s < 0:
            raise ValueError("--engine-deadline and --engine-deadline-per-token must be >= 0")
        if self.kind == "megatron":
            p.check_backend()


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
    max_sample_batch: int = 64  # sample requests in one sampling engine batch
