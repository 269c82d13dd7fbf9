"""The seam between the scheduler and the backends.

Training backends (`lockstep.workers`) implement `TrainingEngine`; sampling backends
(`lockstep.rollout`) implement `SamplingEngine`. The scheduler only ever talks to these verbs, so a
local torch engine, a Megatron worker group or an SGLang fleet are interchangeable behind it.

The training verbs are batch-shaped on purpose: one clock cycle is one `run_passes` call over the
packed work of every tenant, then one `optim_step` call over every adapter that asked for a step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from lockstep.engine.types import (
    LoraSpec,
    ModelCard,
    OptimRequest,
    PassRequest,
    PassResult,
    SampleRequest,
    SampleResult,
)


class UserInputError(ValueError):
    """Bad input from a user: reported as a 400 / a future error with category "user".

    `field` names the offending request field so the message can point at it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message

    def __reduce__(self) -> tuple[type[UserInputError], tuple[str, str]]:
        # Engines run in child processes: the error must survive the trip back.
        return (UserInputError, (self.field, self.detail))


class TrainingEngine(ABC):
    """Holds the base model and every tenant's LoRA adapter and optimizer state."""

    @abstractmethod
    def card(self) -> ModelCard:
        """Describe the served base model (vocab size, context length, tokenizer directory)."""

    @abstractmethod
    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        """Create a fresh adapter (B = 0, A seeded by `spec.seed`) and empty Adam state.

        Raises:
            UserInputError: the spec is invalid (rank < 1, nothing to train).
        """

    @abstractmethod
    def delete_model(self, model_id: str) -> None:
        """Drop an adapter and its optimizer state; unknown ids are ignored."""

    @abstractmethod
    def has_model(self, model_id: str) -> bool:
        """Whether the adapter is resident (False after a worker restart)."""

    @abstractmethod
    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        """Run every request in ONE fused forward (and backward where asked).

        Rows of different models use their own adapter. Gradients of forward_backward requests
        accumulate into each model's adapter until its next `optim_step`. A model's numbers do not
        depend on the other requests in the batch.

        Returns:
            One result per request, in order: per-datum "logprobs" and "elementwise_loss", and
            metrics including "loss:sum".
        Raises:
            UserInputError: a request is malformed (token out of range, shape mismatch, ...).
        """

    @abstractmethod
    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        """Apply one AdamW step to each named adapter (one batched step), then zero its grads.

        Returns:
            model_id -> metrics (e.g. "grad_norm:mean").
        """

    @abstractmethod
    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        """Write the adapter (PEFT layout) and, if asked, the Adam state. Returns bytes written."""

    @abstractmethod
    def load_state(
        self, model_id: str, directory: Path, include_optimizer: bool
    ) -> LoraSpec:
        """Create or replace `model_id` from a `save_state` directory.

        Without `include_optimizer` the Adam state starts fresh.
        Raises:
            UserInputError: the directory is not a checkpoint of this base model.
        """

    @abstractmethod
    def export_adapter(self, model_id: str, directory: Path) -> int:
        """Write PEFT `adapter_model.safetensors` + `adapter_config.json`. Returns bytes."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (child processes, GPU memory)."""


class SamplingEngine(ABC):
    """Generates from the base model with any published adapter."""

    @abstractmethod
    def card(self) -> ModelCard:
        """Describe the served base model."""

    @abstractmethod
    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        """Make a PEFT adapter directory available under `adapter_id` (idempotent)."""

    @abstractmethod
    def unload_adapter(self, adapter_id: str) -> None:
        """Forget an adapter; unknown ids are ignored."""

    @abstractmethod
    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Serve a batch of sample requests (they may use different adapters).

        Returns one result per request, in order. A request that fails on its own input gets
        `SampleResult.error` set instead of failing the batch.
        """

    def release(self) -> None:  # noqa: B027 - optional hook
        """Colocated mode: free accelerator memory before a training phase (no sampling until
        `resume`). Default: nothing to free."""

    def resume(self) -> None:  # noqa: B027 - optional hook
        """Colocated mode: take the memory back after the training phase and re-send whatever
        the release dropped (e.g. loaded adapters)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
