"""The seam between the scheduler and the backends.

Training backends (`lockstep.workers`) implement `TrainingEngine`; sampling backends
(`lockstep.rollout`) implement `SamplingEngine`. The scheduler only ever talks to these verbs, so a
local torch engine, a Megatron worker group or an SGLang fleet are interchangeable behind it.

The training verbs are batch-shaped on purpose: one clock cycle is one `run_passes` call over the
packed work of every tenant, then one `optim_step` call over every adapter that asked for a step.

Lifecycle verbs (`alive`, `restart`, `close`) are part of the contract too: an engine hosted in
another process (a child process, a Ray worker group, an inference server) can die on its own;
it then raises `EngineDied` from any verb, and the scheduler calls `restart` and restores what it
needs from its durable state. An in-process engine never dies alone, so the defaults suffice.

A malformed request is not an engine failure: verbs raise `lockstep.errors.UserInputError`,
which the gateway, the scheduler and every engine share.

An op may bring a verb of its own (`Verb`): the engines that serve it list it in their
capabilities and define it; every other engine is left as it is, and admission refuses the op
where the engine does not serve it (`TrainerCapabilities.check_verb`).
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, ParamSpec, TypeVar, cast

from lockstep.engine.capabilities import SamplerCapabilities, TrainerCapabilities
from lockstep.engine.types import (
    LoraSpec,
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassRequest,
    PassResult,
    SampleRequest,
    SampleResult,
)


class EngineDied(RuntimeError):
    """The engine's process (or one of its workers) exited: its in-memory state (adapters,
    optimizer moments, accumulated gradients) is gone. Not the request's fault: the caller
    restarts the engine and runs the same work again from its recorded state."""


# What torch says when a device error has poisoned the CUDA context (a device-side assert, an
# illegal memory access, a failed launch): every later call on that context fails too.
_DEVICE_ERROR_MARKS = ("CUDA error", "CUDA driver error", "device-side assert")


def is_device_error(exc: BaseException) -> bool:
    """Whether `exc` is a device error that leaves the engine's accelerator context unusable:
    torch's `AcceleratorError`, or a RuntimeError whose message says "CUDA error". Out of memory
    is not one (the allocator recovers; the pass retries in smaller pieces). An engine whose
    call raised one is dead: its host ends the process and raises `EngineDied`."""
    if type(exc).__name__ == "OutOfMemoryError":
        return False
    if any(cls.__name__ == "AcceleratorError" for cls in type(exc).__mro__):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _DEVICE_ERROR_MARKS)


P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Verb(Generic[P, R]):
    """An engine verb an op brings beyond the contract's (`scheduler/ops/base.py`, `Op.verbs`),
    e.g. `Verb[[str, float], float]("sgd_step")`: positional arguments of plain data in, its
    answer out. An engine serves it by listing `name` in its capabilities
    (`TrainerCapabilities.verbs`) and defining a method of that name; an engine in another
    process forwards it like every verb (`serve`)."""

    name: str

    def on(self, engine: TrainingEngine) -> Callable[P, R]:
        """The verb as a call on `engine` (one that serves it: admission checked)."""

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            assert not kwargs, "an engine verb takes positional arguments"
            return cast(R, engine.serve(self.name, *args))

        return call


class TrainingEngine(ABC):
    """Holds the base model and every tenant's LoRA adapter and optimizer state."""

    @abstractmethod
    def card(self) -> ModelCard:
        """Describe the served base model (vocab size, context length, tokenizer directory)."""

    @abstractmethod
    def capabilities(self) -> TrainerCapabilities:
        """What this engine runs on the loaded model: losses (server-side custom ones or not),
        kinds of model input, optimizers (`lockstep.engine.capabilities`). Admission refuses the
        rest by name, so no verb below meets a request the engine cannot run."""

    @abstractmethod
    def memory_budget(self) -> MemoryBudget:
        """What one pass may hold and the longest row that fits in it, found at start-up
        (`lockstep.engine.memory`). The scheduler refuses longer datums at submission, so
        `run_passes` never sees a row its memory cannot hold."""

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

        Failures cost only their request: a request that fails on its own data (its custom loss
        fails or is refused, its loss or gradient is NaN or inf, one of its rows does not fit in
        memory even alone) gets a result with `error` set and leaves no gradient behind, and
        every other request of the call completes with the numbers it would have had without
        it. An engine that cannot tell which request failed raises instead: then the call is
        atomic (every model's accumulated gradients are as they were before it), so the caller
        may run the same requests again, together or one by one. An engine that runs out of
        accelerator memory retries the pass in smaller pieces itself first (numbers unchanged).
        A device error (`is_device_error`) is never a request's failure: the engine is dead.

        Parts (`PassRequest.part`): the scheduler may run one request as parts of whole datums in
        consecutive calls, a part being the only request of its model in its call and nothing
        else of that model running between its parts. Their gradients accumulate as the whole
        request's would, and their results, concatenated and reduced, are the whole request's.
        A FIRST part of a forward_backward keeps the model's accumulated gradients as they are
        before it (the request's undo point) until its LAST part succeeds or `undo_parts`
        restores them; a MIDDLE or LAST part of a model with no undo point (the engine lost
        it: restarted, or the model was deleted or loaded since) raises instead of running.

        Returns:
            One result per request, in order: per-datum "logprobs" and "elementwise_loss", and
            metrics including "loss:sum"; or its `error`.
        Raises:
            UserInputError: a request is malformed (token out of range, shape mismatch, ...).
        """

    @abstractmethod
    def undo_parts(self, model_id: str) -> None:
        """A request of `model_id` run in parts failed: restore the model's gradients to its undo
        point (as they were before the request's FIRST part) and forget it. No undo point (a
        forward, or nothing kept): nothing to do."""

    @abstractmethod
    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        """Apply one AdamW step to each named adapter (one batched step), then zero its grads.

        Returns:
            model_id -> metrics (e.g. "grad_norm:mean").
        """

    @abstractmethod
    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        """Write the adapter (PEFT layout) and, if asked, the Adam state. Returns bytes written."""

    def snapshot(self, model_id: str, directory: Path) -> bool:
        """Snapshot the model (adapter + optimizer state, as `save_state` with the optimizer)
        into `directory`, which appears complete or not at all (written under another name,
        flushed, renamed).

        Returns True if the snapshot is durable on return; False if the state was only copied
        and is being written in the background: `durable_snapshots` reports it once it is.
        Default: written before returning.
        """
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.save_state(model_id, tmp, True)
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        return True

    def durable_snapshots(self) -> list[tuple[str, Path]]:
        """Background snapshots (`snapshot` returned False) now complete on disk, each reported
        once. One in flight when the engine dies is lost: the caller keeps the previous
        snapshot and the ops since, and replays them."""
        return []

    @abstractmethod
    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        """Create or replace `model_id` from a `save_state` directory.

        Without `include_optimizer` the Adam state starts fresh.
        Raises:
            UserInputError: the directory is not a checkpoint of this base model.
        """

    @abstractmethod
    def export_adapter(self, model_id: str, directory: Path) -> int:
        """Write PEFT `adapter_model.safetensors` + `adapter_config.json`. Returns bytes."""

    def serve(self, verb: str, *args: object) -> object:
        """An op's own verb (`Verb`): this engine's method of that name, which it lists in its
        capabilities. Admission refuses an op whose verb the engine does not list, so a verb it
        does not serve never gets here."""
        if verb not in self.capabilities().verbs:
            raise RuntimeError(f"{verb} does not run on the {self.capabilities().engine} engine")
        method: Callable[..., object] = getattr(self, verb)
        return method(*args)

    def alive(self) -> bool:
        """Whether the engine can serve calls (its processes are up). In-process: always."""
        return True

    def restart(self) -> None:  # noqa: B027 - in-process engines never die on their own
        """Replace a dead engine by a fresh one. Every adapter is gone afterwards: the caller
        restores the models it needs (snapshot + replay log)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (child processes, GPU memory)."""


class SamplingEngine(ABC):
    """Generates from the base model with any published adapter."""

    @abstractmethod
    def card(self) -> ModelCard:
        """Describe the served base model."""

    @abstractmethod
    def capabilities(self) -> SamplerCapabilities:
        """What this engine samples from (kinds of prompt input); admission refuses the rest."""

    @abstractmethod
    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        """Make a PEFT adapter directory available under `adapter_id` (idempotent)."""

    def load_adapters(self, adapters: Sequence[tuple[str, Path]]) -> None:
        """Load several adapters in one call (what one cycle published). Engines that can load
        them concurrently override this; by default, one `load_adapter` each."""
        for adapter_id, directory in adapters:
            self.load_adapter(adapter_id, directory)

    @abstractmethod
    def unload_adapter(self, adapter_id: str) -> None:
        """Forget an adapter; unknown ids are ignored."""

    @abstractmethod
    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        """Serve a batch of sample requests (they may use different adapters).

        Returns one result per request, in order. A request that fails on its own input gets
        `SampleResult.error` set instead of failing the batch.
        """

    def sample_slice(self, requests: list[SampleRequest], steps: int) -> list[SampleResult]:
        """Start `requests`, then move every generation this engine is running on by at most
        `steps` decode steps; returns the results of the requests that finished (started now
        or by an earlier call), in any order. The others stay in the engine and go on at the
        next call; a call that raises (or an engine that dies) drops them all, and the caller
        runs them again. A generation run in slices is exactly the generation run in one call,
        token for token.

        Default (an engine that does not slice): the new requests, whole, in one call."""
        return self.sample(requests) if requests else []

    def release(self) -> None:  # noqa: B027 - optional hook
        """Colocated mode: free accelerator memory before a training phase (no sampling until
        `resume`). Default: nothing to free."""

    def resume(self) -> None:  # noqa: B027 - optional hook
        """Colocated mode: take the memory back after the training phase and re-send whatever
        the release dropped (e.g. loaded adapters)."""

    def alive(self) -> bool:
        """Whether the engine can serve calls (its process or server is up)."""
        return True

    def restart(self) -> None:  # noqa: B027 - in-process engines never die on their own
        """Replace a dead engine by a fresh one; adapters are loaded again on demand."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
