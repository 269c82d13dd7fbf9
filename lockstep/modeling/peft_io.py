"""Read and write adapters in the PEFT layout (what `peft.PeftModel.from_pretrained`, vLLM and
SGLang load): `adapter_model.safetensors` with `base_model.model.<path>.lora_{A,B}.weight` keys
plus `adapter_config.json`.

Expert LoRA follows Tinker's adapter format (what tinker-cookbook's `weights` tools read): one
3-D tensor per projection of all a layer's experts, `<experts path>.w1|w3|w2.lora_A.weight`
[experts, rank, in] and `.lora_B.weight` [experts, out, rank] (w1 gate, w3 up, w2 down).
Adapters with one 2-D tensor per expert (`<experts path>.<e>.gate_proj|up_proj|down_proj`, what
the cookbook's `build_lora_adapter` writes for vLLM) are read into that format (gate-less
experts: `up_proj|down_proj` -> w1 / w2). Empty tensors (Tinker's w3 placeholder of gate-less
experts) are written by the model (`LoraModel.adapter_state`) and skipped when read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lockstep.engine.types import LoraSpec
from lockstep.modeling.lora import PEFT_PREFIX

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _leaf_of(key: str) -> str:
    # "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" -> "q_proj"
    return key.rsplit(".", 3)[-3]


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from disk. Which layers it trains is the model's to say
    (`LoraModel.spec_of`), unless a Lockstep checkpoint recorded its spec."""

    state: dict[str, torch.Tensor]
    rank: int
    alpha: float
    spec: LoraSpec | None = None


def save_peft_adapter(
    directory: Path, state: dict[str, torch.Tensor], spec: LoraSpec, base_model_name: str
) -> int:
    """Write the adapter; returns the bytes written (both files)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target_modules = sorted({_leaf_of(k) for k in state})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": target_modules,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    weights_path = directory / ADAPTER_WEIGHTS
    save_file(tensors, str(weights_path), metadata={"format": "pt"})
    config_path = directory / ADAPTER_CONFIG
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return weights_path.stat().st_size + config_path.stat().st_size


def load_peft_adapter(directory: Path) -> PeftAdapter:
    """Read a PEFT LoRA directory.

    Raises:
        ValueError: not a LoRA adapter directory we can serve (missing files, other PEFT type,
            per-module rank/alpha patterns, tensors that are not LoRA A/B matrices).
    """
    directory = Path(directory)
    config_path, weights_path = directory / ADAPTER_CONFIG, directory / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise ValueError(f"{directory}: no {ADAPTER_CONFIG} / {ADAPTER_WEIGHTS}")
    config = json.loads(config_path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{directory}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("use_rslora"):
        raise ValueError(f"{directory}: rsLoRA is not supported")
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    _check_patterns(config, rank, alpha, directory)
    # Empty tensors are placeholders (Tinker's w3 of gate-less experts): nothing to load.
    state = {k: v for k, v in load_file(str(weights_path)).items() if v.numel()}
    # PEFT may store keys with the adapter name ("lora_A.default.weight"); normalise.
    state = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in state.items()
    }
    state = _stack_experts(state, directory)
    bad = [
        k
        for k in state
        if not k.startswith(PEFT_PREFIX) or not k.endswith((".lora_A.weight", ".lora_B.weight"))
    ]
    if bad:
        raise ValueError(f"{directory}: unsupported adapter tensors, e.g. {bad[0]!r}")
    return PeftAdapter(state=state, rank=rank, alpha=alpha)


def _check_patterns(config: dict[str, object], rank: int, alpha: float, directory: Path) -> None:
    """Per-module rank / alpha patterns are accepted only where they keep alpha / rank (a fused
    projection holding several parts' LoRA at a multiple of the rank, as tinker-cookbook's
    `build_lora_adapter` writes Nemotron's Mamba `in_proj`): the parts are split back at load."""
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not isinstance(alphas, dict):
        raise ValueError(f"{directory}: rank_pattern / alpha_pattern must be objects")
    for module in set(ranks) | set(alphas):
        r = float(ranks.get(module, rank))
        a = float(alphas.get(module, alpha))
        if r % rank or abs(a / r - alpha / rank) > 1e-9 * (alpha / rank):
            raise ValueError(
                f"{directory}: rank_pattern / alpha_pattern of {module!r} ({r:g}, {a:g}) change "
                f"the scale alpha / rank = {alpha / rank:g}; not supported"
            )


_PER_EXPERT = re.compile(
    r"^(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(lora_[AB])\.weight$"
)
_TINKER_NAME = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_TINKER_NAME_GATELESS = {"up_proj": "w1", "down_proj": "w2"}  # Nemotron-H's experts


def _stack_experts(state: dict[str, torch.Tensor], directory: Path) -> dict[str, torch.Tensor]:
    """Per-expert 2-D LoRA tensors -> Tinker's 3-D ones (every expert 0..E-1 must be there).
    Experts without any gate_proj tensor are gate-less: their up_proj is w1."""
    matches = [(key, _PER_EXPERT.match(key)) for key in state]
    gated = {m.group(1) for _, m in matches if m is not None and m.group(3) == "gate_proj"}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for key, m in matches:
        if m is None:
            out[key] = state[key]
            continue
        experts, e, proj, lora = m.groups()
        names = _TINKER_NAME if experts in gated else _TINKER_NAME_GATELESS
        groups.setdefault(f"{experts}.{names[proj]}.{lora}.weight", {})[int(e)] = state[key]
    for key, by_expert in groups.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
            raise ValueError(f"{directory}: {key} lacks experts {missing[:8]}")
        out[key] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out
