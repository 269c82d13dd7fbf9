"""MultiLoRALinear / LoraModel: per-row adapters, forward and backward, batch invariance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lockstep.engine.shape import ModelShape
from lockstep.engine.types import LoraSpec
from lockstep.modeling.architecture import Architecture, TrainerPath
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import PEFT_PREFIX, LoraModel
from lockstep.modeling.lora_targets import Role, Target
from lockstep.modeling.tiny import ensure_default_model


class Toy(nn.Module):
    """Two targetable layers (attention-like and unembed-like) and one that is not targeted."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 24)
        self.other = nn.Linear(24, 24)
        self.lm_head = nn.Linear(24, 12, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.other(self.q_proj(x))))


def _toy_lora() -> tuple[Toy, LoraModel]:
    torch.manual_seed(0)
    toy = Toy()
    for p in toy.parameters():
        p.requires_grad_(False)
    # Not a HF model: its LoRA targets are named by hand (q_proj attention, lm_head unembed).
    arch = Architecture(
        shape=ModelShape("toy", hidden=16, vocab=32, layers=(), trainer_path=TrainerPath.GENERIC),
        padded_sampling=True,
        targets=(
            Target("q_proj", Role.ATTN, toy.q_proj),
            Target("lm_head", Role.UNEMBED, toy.lm_head),
        ),
        row_mixers=(),
        experts=(),
    )
    lora = LoraModel(toy, arch)  # type: ignore[arg-type]
    lora.add_adapter("r4", LoraSpec(rank=4, alpha=8.0, seed=1, train_mlp=False))
    lora.add_adapter(
        "r8", LoraSpec(rank=8, alpha=4.0, seed=2, train_mlp=False, train_unembed=False)
    )
    lora.add_adapter("head", LoraSpec(rank=2, seed=3, train_attn=False, train_mlp=False))
    with torch.no_grad():
        for aid in lora.adapter_ids():
            for p in lora.adapter_parameters(aid):
                p.normal_(0, 0.3)
    return toy, lora


def _reference(toy: Toy, lora: LoraModel, x: torch.Tensor, ids: list[str | None]) -> torch.Tensor:
    """Naive: each row on its own, adapter terms written out by hand."""

    def lin(name: str, layer: nn.Linear, h: torch.Tensor, aid: str | None) -> torch.Tensor:
        out = h @ layer.weight.T + (layer.bias if layer.bias is not None else 0)
        key = f"{PEFT_PREFIX}{name}.lora_A.weight"
        if aid is not None and key in lora.adapter_param_names(aid):
            names = lora.adapter_param_names(aid)
            params = dict(zip(names, lora.adapter_parameters(aid), strict=True))
            a, b = params[key], params[key.replace("lora_A", "lora_B")]
            spec = lora.spec(aid)
            out = out + (h @ a.T @ b.T) * (spec.alpha / spec.rank)
        return out

    rows = []
    for r, aid in enumerate(ids):
        h = lin("q_proj", toy.q_proj, x[r], aid)  # type: ignore[arg-type]  # wrapped by LoRA
        h = torch.tanh(h @ toy.other.weight.T + toy.other.bias)
        rows.append(lin("lm_head", toy.lm_head, h, aid))  # type: ignore[arg-type]
    return torch.stack(rows)


@pytest.mark.parametrize(
    "ids",
    [
        # interleaved adapters: one GEMM pair per adapter over its gathered rows
        ["r8", None, "r4", "head", "r4", "r8"],
        # rows ordered by adapter (the trainer's layout): one grouped GEMM pair for all of them,
        # ranks 8, 4 and 2 zero-padded to 8; the base-only rows on either side get no delta
        [None, "r8", "r8", "r4", "r4", "head", None],
    ],
    ids=["per-adapter", "grouped"],
)
def test_forward_and_backward_match_naive_reference(ids: list[str | None]) -> None:
    toy, lora = _toy_lora()
    x = torch.randn(len(ids), 5, 16)
    g = torch.randn(len(ids), 5, 12)
    x1 = x.clone().requires_grad_(True)
    with lora.row_adapters(ids):
        out = toy(x1)
    (out * g).sum().backward()
    got = {
        aid: [torch.clone(p.grad) for p in lora.adapter_parameters(aid) if p.grad is not None]
        for aid in lora.adapter_ids()
    }
    for aid in lora.adapter_ids():
        for p in lora.adapter_parameters(aid):
            p.grad = None
    x2 = x.clone().requires_grad_(True)
    ref = _reference(toy, lora, x2, ids)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert x1.grad is not None and x2.grad is not None
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    for aid, grads in got.items():
        for g1, p in zip(grads, lora.adapter_parameters(aid), strict=True):
            assert p.grad is not None
            torch.testing.assert_close(g1, p.grad, rtol=1e-5, atol=1e-6)


def test_rows_are_independent_of_their_batch() -> None:
    toy, lora = _toy_lora()
    ids: list[str | None] = ["r8", None, "r4", "head", "r4", "r8", "r4", "r8", None]
    # 8 tokens a row: CPU GEMM takes the same kernel class for any M >= 8 (the engine pads rows
    # to a multiple of 8 for this reason). Bits may still differ with M on some CPUs (MKL blocks
    # differently): the invariant is float rounding, not bit equality.
    x = torch.randn(len(ids), 8, 16)
    with lora.row_adapters(ids):
        packed = toy(x)
    for r, aid in enumerate(ids):
        with lora.row_adapters([aid]):
            alone = toy(x[r : r + 1])
        torch.testing.assert_close(alone[0], packed[r], rtol=1e-6, atol=1e-6, msg=str(r))
    assert torch.equal(toy(x[1:2])[0], packed[1])  # outside any context: base only


def test_valid_mask_skips_padding() -> None:
    toy, lora = _toy_lora()
    x = torch.randn(2, 6, 16)
    valid = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    with lora.row_adapters(["r4", "r8"], valid=valid):
        masked = toy(x)
    with lora.row_adapters(["r4", "r8"]):
        full = toy(x)
    base = toy(x)
    assert torch.equal(masked[:, :4], full[:, :4]) and torch.equal(masked[1], full[1])
    assert torch.equal(masked[0, 4:], base[0, 4:])


def test_adapter_management_and_state() -> None:
    toy, lora = _toy_lora()
    assert lora.has_adapter("r4") and not lora.has_adapter("x")
    assert len(lora.adapter_parameters("r8")) == 2  # q_proj only (no unembed)
    state = lora.adapter_state("r4")
    assert list(state) == lora.adapter_param_names("r4")
    assert list(state) == [
        "base_model.model.q_proj.lora_A.weight",
        "base_model.model.q_proj.lora_B.weight",
        "base_model.model.lm_head.lora_A.weight",
        "base_model.model.lm_head.lora_B.weight",
    ]
    lora.load_adapter_state("copy", state, lora.spec("r4"))
    x = torch.randn(1, 3, 16)
    with lora.row_adapters(["copy"]):
        a = toy(x)
    with lora.row_adapters(["r4"]):
        b = toy(x)
    assert torch.equal(a, b)
    with pytest.raises(ValueError):  # shapes do not fit the spec's rank
        lora.load_adapter_state("bad", state, LoraSpec(rank=5, alpha=8.0))
    with pytest.raises(ValueError):  # keys do not match the spec's targets
        lora.load_adapter_state("bad", state, LoraSpec(rank=4, alpha=8.0, train_unembed=False))
    partial = {k: v for k, v in state.items() if "q_proj" in k}
    spec = LoraSpec(rank=4, alpha=8.0, train_mlp=False)
    lora.load_adapter_state("partial", partial, spec, strict=False)
    assert len(lora.adapter_parameters("partial")) == 2
    assert not lora.has_adapter("bad")
    with pytest.raises(ValueError, match="already exists"):
        lora.add_adapter("r4", LoraSpec(rank=4, train_mlp=False))
    with pytest.raises(ValueError, match="train_mlp"):  # this model has no MLP layers
        lora.add_adapter("z", LoraSpec(rank=4))
    with pytest.raises(ValueError):
        lora.add_adapter("z", LoraSpec(rank=0))
    with pytest.raises(ValueError):
        lora.add_adapter("z", LoraSpec(train_attn=False, train_mlp=False, train_unembed=False))
    with pytest.raises(KeyError), lora.row_adapters(["nope"]):
        pass
    with pytest.raises(ValueError), lora.row_adapters(["r4"]):
        toy(torch.randn(2, 3, 16))  # two rows, one routed id
    lora.remove_adapter("r4")
    lora.remove_adapter("r4")  # idempotent
    assert not lora.has_adapter("r4")
    assert all("r4" not in layer.lora_A for layer in lora._layers.values())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def test_qwen_init_is_seeded_and_starts_at_base(model_dir: Path) -> None:
    model, _ = load_base_model(model_dir, "tiny", device="cpu")
    lora = LoraModel(model)
    spec = LoraSpec(rank=8, seed=7)
    lora.add_adapter("a", spec)
    lora.add_adapter("b", spec)
    lora.add_adapter("c", LoraSpec(rank=8, seed=8))
    sa, sb, sc = (lora.adapter_state(k) for k in "abc")
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa[next(iter(sa))], sc[next(iter(sc))])
    a0 = sa["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    assert a0.abs().max() <= 1 / 128**0.5 and a0.std() > 0  # kaiming-uniform bound 1/sqrt(in)
    assert all(not v.any() for k, v in sa.items() if "lora_B" in k)
    # 7 projections x 2 layers + lm_head, A and B each
    assert len(lora.adapter_parameters("a")) == 2 * (7 * 2 + 1)
    ids = torch.randint(0, model.config.vocab_size, (3, 9))
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with lora.row_adapters(["a", None, "c"]):
            routed = model(input_ids=ids).logits
    assert torch.equal(base, routed)  # B = 0: adapters start as the base model


def test_grouped_layout_is_built_once_per_routing() -> None:
    """Group ends and per-token scales go to the device once per routing, not once per layer
    call: a second forward (or the backward's recompute) under the same routing reuses them."""
    toy, lora = _toy_lora()
    ids: list[str | None] = [None, "r8", "r8", "r4", "r4", "head", None]
    x = torch.randn(len(ids), 8, 16)
    with lora.row_adapters(ids):
        routing = lora._slot.current
        assert routing is not None
        first = toy(x)
        built = dict(routing.constants)
        second = toy(x)
    assert len(built) == 2  # q_proj's adapters (r8, r4) and lm_head's (r4, head)
    assert routing.constants.keys() == built.keys()
    assert all(a is b for a, b in zip(routing.constants.values(), built.values(), strict=True))
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_grouped_gemms_in_the_base_dtype_stay_close(monkeypatch: pytest.MonkeyPatch) -> None:
    """GROUPED_IN_BASE_DTYPE (bf16 GEMMs for the grouped LoRA, fp32 parameters and gradients)
    stays within bf16 rounding of the fp32 computation."""
    from lockstep.modeling import linear_lora

    toy, lora = _toy_lora()
    ids: list[str | None] = [None, "r8", "r8", "r4", "r4", "head", None]
    x = torch.randn(len(ids), 8, 16)
    with lora.row_adapters(ids):
        ref = toy(x)
    toy.to(torch.bfloat16)  # the base weights; adapters are held apart and stay fp32
    monkeypatch.setattr(linear_lora, "GROUPED_IN_BASE_DTYPE", True)
    with lora.row_adapters(ids):
        low = toy(x.to(torch.bfloat16))
        low.float().square().sum().backward()
    torch.testing.assert_close(low.float(), ref, rtol=5e-2, atol=5e-2)
    grads = [p.grad for p in lora.adapter_parameters("r8")]
    assert all(g is not None and g.dtype == torch.float32 and g.abs().sum() > 0 for g in grads)
