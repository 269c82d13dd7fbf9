"""Training-state checkpoints: a PEFT adapter directory plus, optionally, the Adam state.

Layout of a `save_state` directory:
    adapter_model.safetensors, adapter_config.json   PEFT adapter (loadable by peft / vLLM)
    lockstep_state.json                              format, base model, LoraSpec, Adam step
    optimizer.safetensors                            "<peft key>.exp_avg" / ".exp_avg_sq"
                                                     (only with include_optimizer, after step 1)
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lockstep.engine.types import LoraSpec
from lockstep.errors import UserInputError
from lockstep.modeling.peft_io import PeftAdapter, load_peft_adapter, save_peft_adapter
from lockstep.training.optim import AdamState

FORMAT = "lockstep-lora-state-v1"
STATE_JSON = "lockstep_state.json"
OPTIMIZER_FILE = "optimizer.safetensors"


def write_state(
    directory: Path,
    adapter: dict[str, torch.Tensor],
    names: list[str],
    spec: LoraSpec,
    base_model: str,
    adam: AdamState | None,
) -> int:
    """Write a checkpoint; `names` orders `adam`'s moments. Returns bytes written."""
    directory = Path(directory)
    size = save_peft_adapter(directory, adapter, spec, base_model)
    meta: dict[str, object] = {"format": FORMAT, "base_model": base_model, "spec": asdict(spec)}
    meta["optimizer"] = None if adam is None else {"step": adam.step}
    if adam is not None and adam.exp_avg:
        tensors = {}
        for name, m, v in zip(names, adam.exp_avg, adam.exp_avg_sq, strict=True):
            tensors[f"{name}.exp_avg"] = m.detach().to("cpu").contiguous()
            tensors[f"{name}.exp_avg_sq"] = v.detach().to("cpu").contiguous()
        save_file(tensors, str(directory / OPTIMIZER_FILE), metadata={"format": "pt"})
        size += (directory / OPTIMIZER_FILE).stat().st_size
    meta_path = directory / STATE_JSON
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return size + meta_path.stat().st_size


def read_adapter(directory: Path, base_model: str) -> PeftAdapter:
    """The adapter of a checkpoint (or of a plain PEFT directory); `spec` is the one recorded by
    a Lockstep checkpoint, None for a plain PEFT directory (the model says what it trains).

    Raises:
        UserInputError("path"): not a checkpoint, or one of another base model.
    """
    directory = Path(directory)
    try:
        adapter = load_peft_adapter(directory)
    except (ValueError, OSError, KeyError) as exc:
        raise UserInputError("path", f"not a LoRA checkpoint: {exc}") from exc
    meta = _read_meta(directory)
    if meta is None:
        return adapter
    if meta.get("base_model") != base_model:
        raise UserInputError(
            "path", f"checkpoint of base model {meta.get('base_model')!r}, not {base_model!r}"
        )
    return replace(adapter, spec=LoraSpec(**meta["spec"]))


def read_adam(directory: Path, names: list[str], params: list[torch.Tensor]) -> AdamState:
    """The Adam state of a checkpoint, moments ordered by `names`, on each param's device."""
    meta = _read_meta(Path(directory))
    if meta is None or meta.get("optimizer") is None:
        raise UserInputError("path", "checkpoint has no optimizer state (saved without it)")
    step = int(meta["optimizer"]["step"])
    if step == 0:
        return AdamState()
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        raise UserInputError("path", f"checkpoint is missing {OPTIMIZER_FILE}")
    tensors = load_file(str(path))
    state = AdamState(step=step)
    for name, p in zip(names, params, strict=True):
        for key, out in (
            (f"{name}.exp_avg", state.exp_avg),
            (f"{name}.exp_avg_sq", state.exp_avg_sq),
        ):
            t = tensors.get(key)
            if t is None or t.shape != p.shape:
                raise UserInputError("path", f"optimizer state {key!r} missing or mis-shaped")
            out.append(t.to(device=p.device, dtype=torch.float32))
    return state


def _read_meta(directory: Path) -> dict[str, Any] | None:
    path = directory / STATE_JSON
    if not path.is_file():
        return None
    meta: dict[str, Any] = json.loads(path.read_text())
    if meta.get("format") != FORMAT:
        raise UserInputError("path", f"unknown checkpoint format {meta.get('format')!r}")
    return meta
