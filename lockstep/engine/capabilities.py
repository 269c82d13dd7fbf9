"""What an engine runs, said by the engine itself: the one place admission and the client
config read it from.

Each engine declares its capabilities (`TrainingEngine.capabilities`,
`SamplingEngine.capabilities`) once it has loaded the model: the losses it computes (server-side
custom losses included or not), the kinds of model input it takes (text; images only for a
vision-language model on an engine that runs its tower), the optimizers it steps. Admission
refuses anything else with a 400 that names the field and the engine, before the request is
queued, through these objects alone: `check_loss` (a forward_backward's loss_fn),
`check_custom_losses` (create_custom_loss), `check_input` (every image chunk, asked by the
engine's `ImageReader`, `engine/images.py`), `check_optimizer` (create_model's optimizer,
optim_step, a load with its optimizer state), `check_verb` (an op that brings its own engine
verb, `Op.verbs`: `Submissions` asks before the op's rules). The client config tells the SDK
only what the configured engines run (`custom_loss_server_side`: the SDK then runs custom
losses itself). So an engine never meets a request it cannot run, and no engine re-checks what
admission judged.

An engine also says which implementation runs each hybrid kernel of the loaded model (the
recurrent layers of Gated DeltaNet and Mamba-2 hybrids: `KernelChoice`), so a fallback to slow
PyTorch shows in `get_info`, the server's capabilities and a metric, never only in a log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from lockstep.engine.losses import CUSTOM, LOSSES
from lockstep.errors import UserInputError
from lockstep.vocab import InputKind, Optimizer

TEXT_INPUTS = frozenset({InputKind.TEXT})
TEXT_AND_IMAGES = frozenset({InputKind.TEXT, InputKind.IMAGE})


class HybridKernel(StrEnum):
    """The sequence kernels of hybrid (linear-attention / state-space) layers."""

    GATED_DELTA_RULE = "gated_delta_rule"  # Gated DeltaNet's chunked recurrence
    SHORT_CONVOLUTION = "short_convolution"  # the causal depthwise conv before either recurrence
    MAMBA2_SCAN = "mamba2_scan"  # Mamba-2's chunked state-space scan (SSD)


class KernelImpl(StrEnum):
    """Who computes a hybrid kernel: a package of the field's (Triton / CUDA kernels) or the
    PyTorch reference (transformers' algorithm; exact, much slower on a GPU)."""

    FLA = "fla"  # flash-linear-attention (fla-core)
    CAUSAL_CONV1D = "causal-conv1d"
    MAMBA_SSM = "mamba-ssm"
    REFERENCE = "reference"


@dataclass(frozen=True)
class KernelChoice:
    """The implementation that runs `kernel` for the loaded model, and why (a field kernel's
    self-check result, or the reason the reference runs)."""

    kernel: HybridKernel
    implementation: KernelImpl
    reason: str


def kernel_map(choices: tuple[KernelChoice, ...]) -> dict[str, str]:
    """kernel -> implementation: what `get_info` and the server's capabilities report."""
    return {c.kernel.value: c.implementation.value for c in choices}


@dataclass(frozen=True)
class TrainerCapabilities:
    """What a training engine runs."""

    engine: str  # its name in refusals: "local", "megatron"
    losses: frozenset[str] = frozenset(LOSSES)  # built-in loss_fn names
    custom_loss: bool = False  # server-side custom losses (create_custom_loss, loss_fn "custom")
    inputs: frozenset[InputKind] = TEXT_INPUTS
    optimizers: frozenset[Optimizer] = field(default_factory=lambda: frozenset(Optimizer))
    kernels: tuple[KernelChoice, ...] = ()  # each hybrid kernel the model uses (none: no hybrid)
    # Verbs ops bring beyond the engine contract that this engine serves (`interface.Verb`).
    verbs: frozenset[str] = frozenset()

    def check_loss(self, loss_fn: str, field: str = "loss_fn") -> None:
        """Raises UserInputError naming `field` and the engine if it does not compute the loss
        (an unknown name is the loss table's refusal, `engine.losses.loss_def`)."""
        if loss_fn == CUSTOM and not self.custom_loss:
            raise UserInputError(
                field,
                f"server-side custom losses do not run on the {self.engine} training engine; "
                "pass forward_backward_custom a plain callable instead (the SDK runs it)",
            )
        if loss_fn in LOSSES and loss_fn not in self.losses:
            raise UserInputError(
                field, f"loss {loss_fn!r} does not run on the {self.engine} training engine"
            )

    def check_custom_losses(self) -> None:
        """create_custom_loss: refused where the engine does not run them."""
        self.check_loss(CUSTOM, "loss")

    def check_input(self, kind: InputKind, field: str) -> None:
        check_input(self.inputs, kind, field, f"the {self.engine} training engine")

    def check_verb(self, verb: str, field: str) -> None:
        """An op whose own engine verb this engine does not serve (`Op.verbs`)."""
        if verb not in self.verbs:
            raise UserInputError(field, f"{verb} does not run on the {self.engine} training engine")

    def check_optimizer(self, optimizer: Optimizer, field: str) -> None:
        if optimizer not in self.optimizers:
            raise UserInputError(
                field,
                f"optimizer {optimizer.value} does not run on the {self.engine} training engine",
            )


@dataclass(frozen=True)
class SamplerCapabilities:
    """What a sampling engine runs."""

    engine: str  # "local", "vllm", "sglang"
    inputs: frozenset[InputKind] = TEXT_INPUTS
    # How the local sampler runs the model (None: an external server's business): its weights'
    # dtype, its decode step ("eager" / "static"), why a model asked to decode "static" decodes
    # eagerly (None: it does not fall back), whether static steps replay as CUDA graphs.
    dtype: str | None = None
    decode: str | None = None
    decode_fallback: str | None = None
    cuda_graphs: bool = False
    kernels: tuple[KernelChoice, ...] = ()  # as the trainer's (an external server's: unknown)

    def check_input(self, kind: InputKind, field: str) -> None:
        check_input(self.inputs, kind, field, f"the {self.engine} sampler")


@dataclass(frozen=True)
class Engines:
    """The configured engines' capabilities, as admission and the client config read them."""

    trainer: TrainerCapabilities
    sampler: SamplerCapabilities


def check_input(taken: frozenset[InputKind], kind: InputKind, field: str, who: str) -> None:
    if kind not in taken:
        raise UserInputError(field, f"{kind.value} chunks are not supported by {who}")
