"""Every architecture of the model zoo (lockstep/modeling/zoo.py), trained and sampled exactly.

Per family (dense, MoE with fused/shared experts, Gated DeltaNet hybrids, sliding windows with
sinks, MLA, and a family left to the generic path):
- the trainer's logprobs equal the HF model's own eager forward on each datum alone, with the
  tenant's adapter merged into the weights by hand (experts included) — an independent reference;
- a tenant alone == packed with another tenant (fp32 <= 1e-5), logprobs and gradients;
- a few SFT steps lower the loss and train every expert projection (w1, w3, w2);
- the sampler's greedy continuation equals HF `generate` on the merged model, its prompt
  logprobs equal the trainer's, and a request alone decodes as it does in a batch.
And the refusals: what no path computes exactly is refused at load, by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lockstep.engine import families
from lockstep.engine.types import (
    AdamConfig,
    Datum,
    LoraSpec,
    OptimRequest,
    PassRequest,
    SampleParams,
    SampleRequest,
)
from lockstep.errors import UnsupportedModel
from lockstep.modeling import zoo
from lockstep.modeling.architecture import TrainerPath, describe
from lockstep.modeling.attention import row_attention_forward
from lockstep.modeling.lora import PEFT_PREFIX
from lockstep.modeling.peft_io import load_peft_adapter
from lockstep.modeling.tiny import init_weights, write_tokenizer
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.workers.local.trainer import LocalTrainingEngine

MOE = {"qwen3_moe", "qwen3_5_moe", "qwen3_next", "gpt_oss", "deepseek_v3", "nemotron_h"}
LENGTHS = (37, 5, 20, 64)  # longer and shorter than gpt-oss's 16-token window
ADAM = AdamConfig(learning_rate=1e-2)
GREEDY = SampleParams(max_tokens=10, temperature=0.0, stop_at_eos=False)


def _datum(length: int, rng: np.random.Generator) -> Datum:
    t = rng.integers(5, 1000, size=length + 1)
    return Datum(
        tokens=t[:-1].astype(np.int64),
        loss_inputs={"target_tokens": t[1:].astype(np.int64), "weights": np.ones(length, "f4")},
    )


def _pass(model_id: str, data: list[Datum], forward_only: bool) -> PassRequest:
    return PassRequest("r", model_id, "cross_entropy", {}, forward_only, data)


@dataclass
class Trained:
    family: str
    directory: Path
    engine: LocalTrainingEngine
    data: list[Datum]
    losses: list[float]
    initial: dict[str, torch.Tensor]  # tenant a's adapter before training


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="module", params=sorted(zoo.FAMILIES))
def trained(request: pytest.FixtureRequest, zoo_dir: Path) -> Iterator[Trained]:
    """Two tenants (ranks 4 and 8) after a few SFT steps on the family's tiny model."""
    family = request.param
    directory = zoo.ensure_family(family, zoo_dir)
    engine = LocalTrainingEngine(directory, zoo.served_name(family), device="cpu")
    rng = np.random.default_rng(0)
    data = [_datum(n, rng) for n in LENGTHS]
    engine.create_model("a", LoraSpec(rank=4, alpha=8.0, seed=1))
    engine.create_model("b", LoraSpec(rank=8, alpha=8.0, seed=2))
    initial = engine._lora.adapter_state("a")
    losses = []
    for _ in range(4):
        out = engine.run_passes([_pass("a", data, False), _pass("b", data[:2], False)])
        losses.append(out[0].metrics["loss:sum"])
        engine.optim_step([OptimRequest("a", ADAM), OptimRequest("b", ADAM)])
    yield Trained(family, directory, engine, data, losses, initial)
    engine.close()


# Tinker's adapter names for slices of a fused transformers projection, in row order (tinker-
# cookbook's weights/_merge_qwen3_5.py, _merge_nemotron.py), and its other renames.
FUSED_PARTS = {
    "in_proj_qkv": ("in_proj_q", "in_proj_k", "in_proj_v"),
    "in_proj": ("gate_proj", "x_proj"),
}
RENAMES = ((".attn.", ".self_attn."),)


def merged_reference(
    directory: Path, adapter: dict[str, torch.Tensor], scale: float
) -> PreTrainedModel:
    """The HF model with a PEFT/Tinker-format adapter added into its weights, written out from
    the adapter format alone (not from Lockstep's layers): W += scale * B @ A; a part of a fused
    projection into its rows (after its earlier parts'); experts: w1 / w3 into gate_up_proj's
    gate / up part, w2 into down_proj, in the module's own layout; gate-less experts: w1 into
    up_proj, w2 into down_proj, the empty w3 skipped."""
    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in adapter.items():
            if not key.endswith(".lora_A.weight") or a.numel() == 0:
                continue
            path = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]
            for tinker, hf in RENAMES:
                if tinker in path and f"{path.replace(tinker, hf)}.weight" in params:
                    path = path.replace(tinker, hf)
            delta = scale * (adapter[key.replace("lora_A", "lora_B")] @ a)  # [(E,) out, in]
            if delta.dim() == 2:
                _add_dense(params, adapter, path, delta)
                continue
            experts_path, which = path.rsplit(".", 1)
            experts = model.get_submodule(experts_path)
            if which == "w2":
                down = params[f"{experts_path}.down_proj"]
                down += delta.transpose(1, 2) if experts.is_transposed else delta
                continue
            if not experts.has_gate:  # w1 is the up projection
                params[f"{experts_path}.up_proj"] += delta
                continue
            fused = params[f"{experts_path}.gate_up_proj"]  # [E, 2I, H] or [E, H, 2I]
            part = 0 if which == "w1" else 1
            if experts.is_transposed:
                fused, delta = fused.transpose(1, 2), delta
            inter = delta.shape[1]
            rows = (
                slice(part, None, 2)
                if not experts.is_concatenated
                else slice(part * inter, (part + 1) * inter)
            )
            fused[:, rows, :] += delta
    return model


def _add_dense(
    params: dict[str, nn.Parameter],
    adapter: dict[str, torch.Tensor],
    path: str,
    delta: torch.Tensor,
) -> None:
    if f"{path}.weight" in params:
        params[f"{path}.weight"] += delta
        return
    parent, leaf = path.rsplit(".", 1)
    for fused, parts in FUSED_PARTS.items():
        if leaf in parts and f"{parent}.{fused}.weight" in params:
            before = parts[: parts.index(leaf)]
            start = sum(
                adapter[f"{PEFT_PREFIX}{parent}.{p}.lora_B.weight"].shape[0] for p in before
            )
            params[f"{parent}.{fused}.weight"][start : start + delta.shape[0]] += delta
            return
    raise KeyError(f"{path}: no parameter of the model takes this adapter tensor")


def _logprobs(model: PreTrainedModel, datum: Datum) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor(datum.tokens)[None]).logits[0].float()
    targets = torch.tensor(datum.loss_inputs["target_tokens"])[:, None]
    return logits.log_softmax(-1).gather(-1, targets)[:, 0].numpy()


def test_trainer_path_is_the_familys(trained: Trained) -> None:
    arch = trained.engine._lora.arch
    assert (arch.model_type in families.PACKED) == trained.engine._packed
    # What get_info / capabilities report (the card travels to the scheduler).
    assert trained.engine.card().trainer_path is arch.trainer_path
    if trained.family == "mistral":  # not a packed family: its own forward, row by row
        assert not trained.engine._packed
        assert trained.engine.card().trainer_path is TrainerPath.GENERIC
    if trained.family in MOE:
        assert arch.experts, "fused experts are LoRA targets"


def test_logprobs_equal_the_models_own_forward(trained: Trained) -> None:
    engine = trained.engine
    spec = engine._lora.spec("a")
    ref = merged_reference(
        trained.directory, engine._lora.adapter_state("a"), spec.alpha / spec.rank
    )
    ours = engine.run_passes([_pass("a", trained.data, True)])[0].outputs
    for datum, out in zip(trained.data, ours, strict=True):
        np.testing.assert_allclose(out["logprobs"], _logprobs(ref, datum), rtol=0, atol=1e-4)


def _grads(engine: LocalTrainingEngine, model_id: str) -> list[torch.Tensor]:
    params = engine._lora.adapter_parameters(model_id)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


def test_a_tenant_alone_equals_packed(trained: Trained) -> None:
    engine, data = trained.engine, trained.data
    alone = engine.run_passes([_pass("a", data, False)])[0]
    grads_alone = _grads(engine, "a")
    packed = engine.run_passes([_pass("b", data[1:], False), _pass("a", data, False)])[1]
    grads_packed = _grads(engine, "a")
    _grads(engine, "b")
    for x, y in zip(alone.outputs, packed.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5)
    for g1, g2 in zip(grads_alone, grads_packed, strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)
    assert any(bool(g.abs().sum() > 0) for g in grads_alone)


def test_the_packed_path_equals_the_generic_path(trained: Trained, tmp_path: Path) -> None:
    if not trained.engine._packed:
        pytest.skip("this family trains on the generic path only")
    trained.engine.export_adapter("a", tmp_path / "a")
    generic = LocalTrainingEngine(
        trained.directory, zoo.served_name(trained.family), "cpu", trainer_path=TrainerPath.GENERIC
    )
    try:
        assert not generic._packed
        generic.load_state("a", tmp_path / "a", False)
        out = [
            e.run_passes([_pass("a", trained.data, False)])[0] for e in (trained.engine, generic)
        ]
        grads = [_grads(e, "a") for e in (trained.engine, generic)]
    finally:
        generic.close()
    for x, y in zip(out[0].outputs, out[1].outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5)
    # Gradients sum over every token in different orders (row SDPA vs the model's own attention,
    # and the grouped GEMMs' blocking): they agree to fp32 rounding relative to their scale
    # (measured: a few 1e-7 of the largest element), not bit for bit.
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=1e-5 * float(g2.abs().max()))


def test_sft_lowers_the_loss_and_trains_every_expert_projection(trained: Trained) -> None:
    """Every expert's own slice of every expert LoRA tensor moved (not just the tensor: one
    expert moving would not do), in Tinker's 3-D layout; gate-less experts keep an empty w3."""
    assert trained.losses[-1] < trained.losses[0]
    state = trained.engine._lora.adapter_state("a")
    experts = [k for k in state if ".experts.w" in k]
    if trained.family not in MOE:
        assert not experts
        return
    layers = trained.engine._lora.arch.experts
    assert {k.rsplit(".", 3)[-3] for k in experts} == {"w1", "w2", "w3"}
    assert len(experts) == 6 * len(layers)
    moved = 0
    for key in experts:
        tensor, before = state[key], trained.initial[key]
        if tensor.numel() == 0:  # Tinker's placeholder w3 of gate-less experts
            assert trained.family == "nemotron_h" and ".w3." in key
            continue
        assert tensor.dim() == 3 and tensor.shape[0] > 1  # [experts, ...]
        for e in range(tensor.shape[0]):
            assert (tensor[e] - before[e]).abs().max() > 0, f"{key}: expert {e} did not train"
            moved += 1
    assert moved >= 4 * len(layers) * 2  # w1 and w2 A / B of at least 2 experts per layer


def test_sampler_equals_the_model_and_the_trainer(trained: Trained, tmp_path: Path) -> None:
    engine = trained.engine
    engine.export_adapter("a", tmp_path / "a")
    spec = engine._lora.spec("a")
    ref = merged_reference(
        trained.directory, load_peft_adapter(tmp_path / "a").state, spec.alpha / spec.rank
    )
    sampler = LocalSamplingEngine(trained.directory, zoo.served_name(trained.family))
    try:
        sampler.load_adapter("a", tmp_path / "a")
        prompts = [d.tokens.tolist() for d in trained.data[:3]] + [[5, 17, 300]]
        requests = [
            SampleRequest(str(i), "a", p, 2, GREEDY, prompt_logprobs=True)
            for i, p in enumerate(prompts)
        ]
        batched = sampler.sample(requests)
        alone = sampler.sample(requests[:1])[0]
    finally:
        sampler.close()
    trainer = engine.run_passes([_pass("a", trained.data[:3], True)])[0].outputs
    for i, (prompt, result) in enumerate(zip(prompts, batched, strict=True)):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert all(s.tokens == want[0, len(prompt) :].tolist() for s in result.sequences), i
        assert result.prompt_logprobs is not None
        if i < 3:  # the trainer's logprob of token t+1 given the prompt up to t
            got = np.array(result.prompt_logprobs[1:], dtype=np.float32)
            np.testing.assert_allclose(got, trainer[i]["logprobs"][: len(prompt) - 1], atol=1e-4)
    assert alone.sequences[0].tokens == batched[0].sequences[0].tokens


# -- refusals: never silently wrong ---------------------------------------------------------


class _OddExperts(nn.Module):
    """Experts stored as 3-D projections but not in transformers' fused layout."""

    def __init__(self, experts: int, hidden: int) -> None:
        super().__init__()
        self.w_in_proj = nn.Parameter(torch.zeros(experts, hidden, hidden))


def test_experts_in_an_unknown_layout_are_refused(zoo_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(zoo.ensure_family("qwen3_moe", zoo_dir))
    model.model.layers[1].mlp.experts = _OddExperts(8, 64)
    with pytest.raises(UnsupportedModel, match=r"model\.layers\.1\.mlp\.experts \(_OddExperts\)"):
        describe(model)


def test_logit_soft_capping_is_refused(tmp_path: Path) -> None:
    eos, vocab = write_tokenizer(tmp_path)
    config = AutoConfig.for_model(
        "gemma2",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        final_logit_softcapping=30.0,
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=eos,
    )
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, std=0.5)  # logits big enough for the cap to bend them
    model.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel, match="final_logit_softcapping=30.0"):
        LocalTrainingEngine(tmp_path, "gemma2-capped", device="cpu")


@pytest.mark.parametrize(("option", "value"), [("softcap", 50.0), ("dropout", 0.1)])
def test_row_attention_refuses_what_it_does_not_compute(option: str, value: float) -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError):
        row_attention_forward(nn.Module(), q, q, q, None, **{option: value})


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_external_samplers_refuse_families_they_do_not_serve_exactly(
    kind: str, zoo_dir: Path, tmp_path: Path
) -> None:
    from lockstep.config import SamplerConfig
    from lockstep.rollout.config import check_external_family, start_sampler

    for family in sorted(zoo.FAMILIES):
        directory = zoo.ensure_family(family, zoo_dir)
        model_type = describe_type(directory)
        if model_type in families.EXTERNAL_LORA:
            check_external_family(kind, directory)
            continue
        # Refused before anything is launched (no python exists at that path).
        cfg = SamplerConfig(kind=kind, **{f"{kind}_python": tmp_path / "no-such-python"})
        with pytest.raises(UnsupportedModel, match=rf"--sampler {kind} .*'{model_type}'"):
            start_sampler(cfg, directory, zoo.served_name(family), tmp_path)


def describe_type(directory: Path) -> str:
    """The language model's model_type (a published vision-language checkpoint's text model)."""
    return str(AutoConfig.from_pretrained(directory).get_text_config().model_type)


def test_the_zoo_script_builds_a_servable_directory(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "scripts" / "build_tiny_models.py"
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "qwen3_moe"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    name, directory = out.split("=")
    assert name == zoo.served_name("qwen3_moe")
    assert describe_type(Path(directory)) == "qwen3_moe"
    bad = subprocess.run([sys.executable, str(script), str(tmp_path), "nope"], capture_output=True)
    assert bad.returncode == 2 and b"unknown families ['nope']" in bad.stderr
