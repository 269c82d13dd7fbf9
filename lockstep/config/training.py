"""The training engine's section of the root config (`EngineConfig`) and the parallel layout
of a Megatron worker group (`ParallelConfig`, its `parallel` field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lockstep.config.flags import SCHEDULER, flag

EngineKind = Literal["local", "megatron"]
# Ray placement-group strategy for the megatron ranks (one bundle per rank): PACK as few nodes as
# possible (TP ranks share a node's links), SPREAD across nodes, STRICT_* or fail.
RayPlacement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
DtypeName = Literal["float32", "bfloat16"]  # lockstep.engine.types.Dtype
CheckpointingName = Literal["auto", "always", "never"]  # lockstep.engine.types.Checkpointing
# A 4096-token micro-batch of SmolLM2-135M keeps ~7.5 GB of fp32 activations; 1024 fits a CPU box.
DEFAULT_MICRO_BATCH_TOKENS = 1024
# Snapshots cost I/O per tenant (a Qwen3-8B rank-32 adapter + Adam moments is ~1 GB); the replay
# log covers the steps between them, so a restart recomputes at most this much of a run's work.
DEFAULT_SNAPSHOT_INTERVAL_S = 10.0
TE_MISSING = (
    "needs NVIDIA Transformer Engine, which is not installed: megatron-core runs context "
    "parallel only in TEDotProductAttention and sequence parallel only with TE norms/linears"
)


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
    activation_checkpointing: CheckpointingName = field(
        default="auto",
        metadata=flag(
            "--activation-checkpointing",
            help="recompute decoder layers in backward instead of keeping their activations: "
            "auto, the fewest layers a micro-batch needs to fit the memory budget (admission "
            "counts a pass with every layer recomputed); always, every layer (and on CPU freed "
            "activation memory goes back to the OS); never (--engine local)",
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
