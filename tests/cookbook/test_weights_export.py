"""Lockstep's adapters of mixture-of-experts models read by tinker-cookbook's own weights tools.

Per MoE family of the zoo: a tenant trains a few SFT steps on the local engine and exports its
adapter (Tinker's format: experts as 3-D `w1`/`w3`/`w2` LoRA tensors). The cookbook venv's
unmodified `weights.build_hf_model` merges it into the base model; the merged model's own
forward gives the trainer's logprobs. Where the cookbook builds PEFT adapters for the family,
`weights.build_lora_adapter`'s per-expert tensors are slices of ours. The exported directory and
the cookbook's per-expert PEFT adapter load back into other tenants with the same logprobs.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

from .conftest import DRIVERS, offline_env

pytestmark = [pytest.mark.cookbook]

# The cookbook's build_lora_adapter refuses DeepSeek-V3 by model type (merging works).
PEFT_FAMILIES = {"qwen3_moe", "qwen3_5_moe", "gpt_oss"}


def _data() -> list[Datum]:
    rng = np.random.default_rng(0)
    data = []
    for n in (33, 12, 20):
        t = rng.integers(5, 1000, size=n + 1)
        data.append(
            Datum(
                tokens=t[:-1].astype(np.int64),
                loss_inputs={"target_tokens": t[1:].astype(np.int64), "weights": np.ones(n, "f4")},
            )
        )
    return data


def _forward(engine: LocalTrainingEngine, model_id: str, data: list[Datum]) -> list[np.ndarray]:
    out = engine.run_passes([PassRequest("r", model_id, "cross_entropy", {}, True, data)])
    return [o["logprobs"] for o in out[0].outputs]


def _hf_logprobs(directory: Path, datum: Datum) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor(datum.tokens)[None]).logits[0].float()
    targets = torch.tensor(datum.loss_inputs["target_tokens"])[:, None]
    return logits.log_softmax(-1).gather(-1, targets)[:, 0].numpy()


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5_moe", "gpt_oss", "deepseek_v3"])
def test_cookbook_tools_read_moe_adapters(
    family: str, zoo_dir: Path, cookbook_python: Path, tmp_path: Path
) -> None:
    base = zoo.ensure_family(family, zoo_dir)
    engine = LocalTrainingEngine(base, zoo.served_name(family), device="cpu")
    data = _data()
    try:
        engine.create_model("a", LoraSpec(rank=4, alpha=8.0, seed=1))
        for _ in range(3):  # B starts at zero: train so every delta is nonzero
            engine.run_passes([PassRequest("r", "a", "cross_entropy", {}, False, data)])
            engine.optim_step([OptimRequest("a", AdamConfig(learning_rate=1e-2))])
        ours = _forward(engine, "a", data)
        adapter = tmp_path / "adapter"
        engine.export_adapter("a", adapter)
        exported = load_file(str(adapter / "adapter_model.safetensors"))
        assert any(t.dim() == 3 for k, t in exported.items() if ".experts.w" in k)

        home = tmp_path / "home"
        home.mkdir()
        cfg = {
            "base_model": str(base),
            "adapter_path": str(adapter),
            "out_dir": str(tmp_path / "out"),
            "peft": family in PEFT_FAMILIES,
        }
        proc = subprocess.run(
            [str(cookbook_python), str(DRIVERS / "weights_export.py"), json.dumps(cfg)],
            capture_output=True,
            text=True,
            env=offline_env(home),
            cwd=home,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-5000:]

        # The merged model's own forward == the trainer with the adapter (which moved it).
        for datum, want in zip(data, ours, strict=True):
            got = _hf_logprobs(tmp_path / "out" / "merged", datum)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
            assert np.abs(_hf_logprobs(base, datum) - want).max() > 1e-2

        if cfg["peft"]:
            _check_peft_slices(
                exported, load_file(str(tmp_path / "out/peft/adapter_model.safetensors"))
            )

        # The exported adapter, and the cookbook's per-expert PEFT one, load back.
        engine.load_state("c", adapter, False)
        for x, y in zip(_forward(engine, "c", data), ours, strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
        if cfg["peft"]:
            engine.load_state("d", tmp_path / "out" / "peft", False)
            for x, y in zip(_forward(engine, "d", data), ours, strict=True):
                np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    finally:
        engine.close()


PEFT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _check_peft_slices(ours: dict[str, torch.Tensor], peft: dict[str, torch.Tensor]) -> None:
    """The cookbook's PEFT adapter: dense targets as ours, each expert's gate/up/down LoRA the
    expert's slice of our w1/w3/w2 tensors, and nothing else."""
    want: dict[str, torch.Tensor] = {}
    for key, tensor in ours.items():
        if tensor.dim() == 2:
            want[key] = tensor
            continue
        experts, which, lora, weight = key.rsplit(".", 3)  # ….experts, w1, lora_A, weight
        for e in range(tensor.shape[0]):
            want[f"{experts}.{e}.{PEFT_NAMES[which]}.{lora}.{weight}"] = tensor[e]
    assert sorted(peft) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(peft[key].float(), tensor.float(), rtol=0, atol=0, msg=key)
