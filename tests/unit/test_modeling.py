"""The default tiny model, the base-model loader and the PEFT adapter files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.engine.types import LoraSpec
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import load_peft_adapter, save_peft_adapter
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_build_is_deterministic_and_cached(model_dir: Path, tmp_path: Path) -> None:
    other = ensure_default_model(tmp_path / "elsewhere")
    assert other.name == model_dir.name
    names = sorted(p.name for p in model_dir.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(p.name for p in other.iterdir())
    for name in names:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name
    stamp = (other / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(tmp_path / "elsewhere") == other  # no rebuild
    assert (other / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in other.parent.iterdir() if p.name.startswith(".build-")]


def test_auto_classes_load_it_offline(model_dir: Path) -> None:
    # A fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE at import time.
    script = f"""
import json
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
d = {str(model_dir)!r}
tok = AutoTokenizer.from_pretrained(d)
cfg = AutoConfig.from_pretrained(d)
model = AutoModelForCausalLM.from_pretrained(d)
ids = [tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
print(json.dumps(dict(
    n=len(tok), vocab=cfg.vocab_size, head_dim=cfg.head_dim, model_type=cfg.model_type,
    tied=cfg.tie_word_embeddings, eos=tok.eos_token_id, pad=tok.pad_token_id, ids=ids,
    single=[len(tok.encode(t, add_special_tokens=False)) for t in ("<|im_start|>", "<|im_end|>")],
    roundtrip=tok.decode(tok.encode("Hello, world! 42")),
    chat=tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False,
                                 add_generation_prompt=True),
    cls=type(model).__name__, dtype=str(next(model.parameters()).dtype))))
"""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["cls"] == "Qwen3ForCausalLM" and info["model_type"] == "qwen3"
    assert info["head_dim"] == 64 and info["tied"] is False and info["dtype"] == "torch.float32"
    assert 900 <= info["n"] <= info["vocab"]
    assert info["eos"] == info["pad"] == info["ids"][0]
    assert info["single"] == [1, 1] and len(set(info["ids"])) == 3
    assert info["roundtrip"] == "Hello, world! 42"
    assert info["chat"] == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_load_base_model(model_dir: Path) -> None:
    model, card = load_base_model(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    assert card.name == DEFAULT_MODEL_NAME and card.arch == "qwen3"
    assert card.directory == str(model_dir.resolve())
    assert card.vocab_size == model.config.vocab_size and card.max_context_length == 4096
    assert card.eos_token_id == 0
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_peft_files_round_trip(model_dir: Path, tmp_path: Path) -> None:
    model, _ = load_base_model(model_dir, DEFAULT_MODEL_NAME, device="cpu")
    lora = LoraModel(model)
    spec = LoraSpec(rank=4, alpha=8.0, seed=3, train_attn=True, train_mlp=False)
    lora.add_adapter("a", spec)
    state = lora.adapter_state("a")
    size = save_peft_adapter(tmp_path / "ad", state, spec, DEFAULT_MODEL_NAME)
    assert size == sum(p.stat().st_size for p in (tmp_path / "ad").iterdir())
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == DEFAULT_MODEL_NAME
    assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    adapter = load_peft_adapter(tmp_path / "ad")
    loaded = adapter.state
    assert (adapter.rank, adapter.alpha, adapter.spec) == (4, 8.0, None)
    assert lora.spec_of(loaded, adapter.rank, adapter.alpha) == LoraSpec(
        rank=4, alpha=8.0, seed=None, train_attn=True, train_mlp=False
    )
    assert loaded.keys() == state.keys()
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in loaded
    assert "base_model.model.lm_head.lora_B.weight" in loaded
    with pytest.raises(ValueError):
        load_peft_adapter(tmp_path / "missing")
