"""The local trainer's adapters to and from files: checkpoints (adapter + Adam moments, the file
layout of `training.checkpoint`, shared with the Megatron engine), snapshots written in the
background, and PEFT exports. The engine keeps its bookkeeping (which Adam state is whose, undo
points); these read and write.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from lockstep.engine.types import LoraSpec
from lockstep.errors import UserInputError
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.training import checkpoint
from lockstep.training.optim import AdamState


def save_state(
    lora: LoraModel, model_id: str, directory: Path, base_model: str, adam: AdamState | None
) -> int:
    """Write `model_id`'s checkpoint (with `adam`'s moments unless None); bytes written."""
    return checkpoint.write_state(
        Path(directory),
        lora.adapter_state(model_id),
        lora.adapter_param_names(model_id),
        lora.spec(model_id),
        base_model,
        adam,
    )


def copy_state(
    lora: LoraModel, model_id: str, base_model: str, adam: AdamState
) -> Callable[[Path], int]:
    """The adapter and Adam moments copied now (detached CPU copies); the returned function
    writes them as a checkpoint into a directory later (a snapshot, off the cycle's path)."""
    adapter = lora.adapter_state(model_id)
    names, spec = lora.adapter_param_names(model_id), lora.spec(model_id)
    moments = AdamState(
        adam.step,
        [t.detach().to("cpu", copy=True) for t in adam.exp_avg],
        [t.detach().to("cpu", copy=True) for t in adam.exp_avg_sq],
    )
    return lambda tmp: checkpoint.write_state(tmp, adapter, names, spec, base_model, moments)


def read_state(
    lora: LoraModel, model_id: str, directory: Path, base_model: str, include_optimizer: bool
) -> tuple[dict[str, torch.Tensor], LoraSpec, AdamState]:
    """A checkpoint's adapter (in this model's adapter names), its spec and its Adam state
    (fresh unless `include_optimizer`), checked to fit the model by building it under a scratch
    id first, so a bad checkpoint leaves `model_id` untouched.

    Raises:
        UserInputError("path"): not a checkpoint of this base model, or one that does not fit.
    """
    adapter = checkpoint.read_adapter(Path(directory), base_model)
    try:
        state = lora.tinker_names(adapter.state, adapter.rank)
    except ValueError as exc:
        raise UserInputError("path", f"checkpoint does not fit this base model: {exc}") from exc
    spec = adapter.spec or lora.spec_of(state, adapter.rank, adapter.alpha)
    scratch = f"{model_id}\x00loading"
    try:
        lora.check_spec(spec)
        lora.load_adapter_state(scratch, state, spec)
    except ValueError as exc:
        raise UserInputError("path", f"checkpoint does not fit this base model: {exc}") from exc
    try:
        adam = AdamState()
        if include_optimizer:
            adam = checkpoint.read_adam(
                Path(directory),
                lora.adapter_param_names(scratch),
                list(lora.adapter_parameters(scratch)),
            )
    finally:
        lora.remove_adapter(scratch)
    return state, spec, adam


def export_adapter(lora: LoraModel, model_id: str, directory: Path, base_model: str) -> int:
    """Write `model_id` as a PEFT adapter directory; bytes written."""
    return save_peft_adapter(
        Path(directory), lora.adapter_state(model_id), lora.spec(model_id), base_model
    )
