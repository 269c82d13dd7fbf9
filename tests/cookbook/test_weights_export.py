"""Lockstep checkpoints of every model family read by tinker-cookbook's own weights tools.

Per family of the zoo (each saved in its published layout): a tenant trains a few SFT steps on
the local engine and saves a checkpoint (`save_state`: Tinker's adapter names and format, experts
as 3-D `w1`/`w3`/`w2` LoRA tensors). The cookbook venv's unmodified `weights.build_hf_model`
merges it into the base model, and its transformers (an older release than the service's) reads
the base and the merged model: the base gives the same logprobs as the service's transformers
(both read our checkpoints alike) and the merged model the trainer's logprobs with the adapter
(<= 1e-4), which moved them. Where the cookbook builds PEFT adapters for the family
(`weights.build_lora_adapter`; it refuses DeepSeek-V3), that adapter is exactly our tensors in
transformers' names (per-expert 2-D, fused projections joined), and `load_state` of it, and of
our own checkpoint, gives another tenant the same logprobs. One driver process serves every
family (the cookbook venv starts once).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import zoo
from lockstep.modeling.peft_io import load_peft_adapter
from lockstep.workers.local.trainer import LocalTrainingEngine

from .conftest import DRIVERS, offline_env

pytestmark = [pytest.mark.cookbook]

FAMILIES = sorted(zoo.FAMILIES)
# The cookbook's build_lora_adapter refuses DeepSeek-V3 by model type (merging works).
NO_PEFT = {"deepseek_v3"}
RANK = 4


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


def _rows(data: list[Datum]) -> list[list[int]]:
    return [[*d.tokens.tolist(), int(d.loss_inputs["target_tokens"][-1])] for d in data]


def _forward(engine: LocalTrainingEngine, model_id: str, data: list[Datum]) -> list[np.ndarray]:
    out = engine.run_passes([PassRequest("r", model_id, "cross_entropy", {}, True, data)])
    return [o["logprobs"] for o in out[0].outputs]


def _hf_logprobs(directory: Path, data: list[Datum]) -> list[np.ndarray]:
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    out = []
    for datum in data:
        with torch.no_grad():
            logits = model(torch.tensor(datum.tokens)[None]).logits[0].float()
        targets = torch.tensor(datum.loss_inputs["target_tokens"])[:, None]
        out.append(logits.log_softmax(-1).gather(-1, targets)[:, 0].numpy())
    return out


@dataclass
class Exported:
    base: Path
    engine: LocalTrainingEngine
    checkpoint: Path
    out: Path
    ours: list[np.ndarray]  # the trainer's logprobs with the adapter


@pytest.fixture(scope="module")
def exported(
    tmp_path_factory: pytest.TempPathFactory, cookbook_python: Path
) -> Iterator[dict[str, Exported]]:
    """Every family trained and checkpointed, then one cookbook driver run over them all."""
    root = tmp_path_factory.mktemp("weights")
    data = _data()
    done: dict[str, Exported] = {}
    jobs = []
    for family in FAMILIES:
        base = zoo.ensure_family(family, root / "zoo")
        engine = LocalTrainingEngine(base, zoo.served_name(family), device="cpu")
        engine.create_model("a", LoraSpec(rank=RANK, alpha=8.0, seed=1))
        for _ in range(3):  # B starts at zero: train so every delta is nonzero
            engine.run_passes([PassRequest("r", "a", "cross_entropy", {}, False, data)])
            engine.optim_step([OptimRequest("a", AdamConfig(learning_rate=1e-2))])
        checkpoint = root / family / "checkpoint"
        engine.save_state("a", checkpoint, include_optimizer=False)
        out = root / family / "out"
        done[family] = Exported(base, engine, checkpoint, out, _forward(engine, "a", data))
        jobs.append(
            {
                "base_model": str(base),
                "adapter_path": str(checkpoint),
                "out_dir": str(out),
                "peft": family not in NO_PEFT,
                "tokens": _rows(data),
            }
        )
    home = root / "home"
    home.mkdir()
    proc = subprocess.run(
        [str(cookbook_python), str(DRIVERS / "weights_export.py"), json.dumps({"jobs": jobs})],
        capture_output=True,
        text=True,
        env=offline_env(home),
        cwd=home,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    yield done
    for item in done.values():
        item.engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_cookbook_tools_read_our_checkpoints(family: str, exported: dict[str, Exported]) -> None:
    item = exported[family]
    data = _data()
    theirs = json.loads((item.out / "logprobs.json").read_text())
    # Both transformers versions read our published-layout checkpoint alike (to the rounding of
    # their kernels: their Mamba-2 scans differ in the last bits).
    for got, want in zip(theirs["base"], _hf_logprobs(item.base, data), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
    # The cookbook's merge == the trainer with the adapter (which moved the logprobs), read by
    # the cookbook's transformers and by ours.
    for got, mine, want, base in zip(
        theirs["merged"],
        _hf_logprobs(item.out / "merged", data),
        item.ours,
        theirs["base"],
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        np.testing.assert_allclose(mine, want, rtol=0, atol=1e-4)
        assert np.abs(np.asarray(base) - want).max() > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoints_and_cookbook_peft_adapters_load_back(
    family: str, exported: dict[str, Exported]
) -> None:
    item, data = exported[family], _data()
    engine = item.engine
    ours = load_file(str(item.checkpoint / "adapter_model.safetensors"))
    engine.load_state("c", item.checkpoint, False)
    for x, y in zip(_forward(engine, "c", data), item.ours, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
    if family in NO_PEFT:
        assert not (item.out / "peft").exists()
        return
    # The cookbook's PEFT adapter (transformers' names, per-expert 2-D tensors, fused
    # projections joined) is exactly our tensors once read back into Tinker's names.
    peft = load_peft_adapter(item.out / "peft")
    read = engine._lora.tinker_names(peft.state, peft.rank)
    want = {k: v for k, v in ours.items() if v.numel()}  # placeholders are not tensors
    assert sorted(read) == sorted(want)
    for key, tensor in want.items():
        torch.testing.assert_close(read[key].float(), tensor.float(), rtol=0, atol=0, msg=key)
    engine.load_state("d", item.out / "peft", False)
    for x, y in zip(_forward(engine, "d", data), item.ours, strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-6)
