"""The hybrid layers' packed path and the choice of their kernels (lockstep/modeling/mixers.py,
hybrid_kernels.py, hybrid_reference.py, hybrid_field.py).

On every machine:
- each reference kernel, vectorised over a packed micro-batch's rows, equals transformers' own
  function run on each row alone (output and input gradients);
- for every hybrid family of the zoo, the packed mixers (every row in one call per kernel) equal
  transformers' own forward run once per row (what ran before): logprobs and every adapter
  gradient of two tenants, fp32 <= 1e-5; and a tenant alone == packed;
- the choice: a CPU, float32 weights, a switch or a missing package run the reference and say
  why (a warning on CUDA); the self-check passes a correct kernel and refuses one that lets
  rows leak into each other.
fla's kernels themselves, on a CPU: in Triton's interpreter (float32; Triton and fla installed
once into a cached directory beside the suite, tests/fla_interpreter/), each equals the reference,
output and every input gradient, rows of unequal lengths in one varlen call.
On a CUDA device with fla installed (else skipped, saying what is not tested): each of fla's
kernels equals the reference at production shapes in bf16 and fp16, and every hybrid family
trains with them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lockstep.engine.capabilities import HybridKernel, KernelImpl
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling import hybrid_field, hybrid_kernels, hybrid_reference, mixers, zoo
from lockstep.modeling.hybrid_kernels import Shapes
from lockstep.modeling.packing import Packing
from lockstep.workers.local.trainer import LocalTrainingEngine
from tests.overlays import overlay

HYBRID = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h")
# Rows longer than one 64-token delta-rule chunk and than several 16-token Mamba chunks.
LENGTHS = (100, 37, 5, 64)
CUDA = torch.cuda.is_available()
FLA = importlib.util.find_spec("fla") is not None
INTERPRETER = Path(__file__).resolve().parents[1] / "fla_interpreter"


def _rows(lengths: tuple[int, ...]) -> Packing:
    return hybrid_kernels.rows(lengths)


# -- the reference kernels against transformers' own, row by row ---------------------------


@pytest.mark.skipif(FLA, reason="fla is installed: transformers' functions would call it")
def test_reference_kernels_equal_transformers_on_each_row() -> None:
    from transformers.models.nemotron_h import modeling_nemotron_h as nemotron
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    lengths = (100, 8, 40)
    rows, t = _rows(lengths), sum(lengths)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).requires_grad_()

    def per_row(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
        pieces = zip(*(x.split(list(lengths), dim=1) for x in xs), strict=True)
        return torch.cat([fn(*p) for p in pieces], dim=1)

    def same(ours: torch.Tensor, theirs: torch.Tensor, inputs: list[torch.Tensor]) -> None:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        up = torch.randn(ours.shape, generator=gen)
        mine = torch.autograd.grad(ours, inputs, up, retain_graph=True)
        want = torch.autograd.grad(theirs, inputs, up)
        for a, b in zip(mine, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    # The short convolution, with a bias, through silu.
    x, w, bias = rand(1, t, 24), rand(24, 4), rand(24)
    ours = hybrid_reference.short_convolution(x, w, bias, "silu", rows)
    theirs = per_row(
        lambda p: qwen.causal_conv1d_fn(p.transpose(1, 2), w, bias, "silu").transpose(1, 2), x
    )
    same(ours, theirs, [x, w, bias])

    # The gated delta rule, 4 value heads over 2 key heads (transformers 5.17 repeats the key
    # heads before its kernel, 5.24 inside: repeated here, the same for both).
    q, k, v = rand(1, t, 2, 16), rand(1, t, 2, 16), rand(1, t, 4, 8)
    a, b = rand(1, t, 4), rand(1, t, 4)
    g, beta = -F.softplus(a) * 0.5, b.sigmoid()
    ours = hybrid_reference.gated_delta_rule(q, k, v, g, beta, rows)

    def delta(q: Any, k: Any, v: Any, g: Any, beta: Any) -> torch.Tensor:
        q, k = q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2)
        out, _ = qwen.torch_chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True
        )
        return out

    same(ours, per_row(delta, q, k, v, g, beta), [q, k, v, a, b])

    # Mamba-2's scan: 4 heads over 2 groups, chunks of 16, a dt floor.
    x, dt, bb, cc = rand(1, t, 4, 8), rand(1, t, 4), rand(1, t, 2, 16), rand(1, t, 2, 16)
    a_log, d, dt_bias = torch.log(torch.arange(1.0, 5.0)), rand(4), rand(4)
    limit = (0.05, float("inf"))
    ours = hybrid_reference.mamba2_scan(x, dt, -a_log.exp(), bb, cc, d, dt_bias, limit, 16, rows)

    def scan(x: Any, dt: Any, bb: Any, cc: Any) -> torch.Tensor:
        return nemotron.mamba2_chunk_scan(
            x, dt, -a_log.exp(), bb, cc, 16, D=d, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit
        )

    same(ours, per_row(scan, x, dt, bb, cc), [x, dt, bb, cc, d, dt_bias])


# -- every hybrid family: packed == transformers' per-row forward --------------------------


def _datum(length: int, rng: np.random.Generator) -> Datum:
    t = rng.integers(5, 1000, size=length + 1)
    return Datum(
        tokens=t[:-1].astype(np.int64),
        loss_inputs={"target_tokens": t[1:].astype(np.int64), "weights": np.ones(length, "f4")},
    )


def _pass(model_id: str, data: list[Datum]) -> PassRequest:
    return PassRequest("r", model_id, "cross_entropy", {}, False, data)


def _grads(engine: LocalTrainingEngine, model_id: str) -> list[torch.Tensor]:
    params = engine._lora.adapter_parameters(model_id)
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


@dataclass
class Family:
    name: str
    engine: LocalTrainingEngine
    data: list[Datum]


@pytest.fixture(scope="module", params=HYBRID)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Family]:
    """Two tenants of the family's tiny model on the CPU, one Adam step in (their LoRA B off
    zero)."""
    if FLA:  # transformers' own layers then call fla, whose Triton kernels take no CPU tensors
        pytest.skip("fla is installed: transformers' forward on the CPU would call its kernels")
    name = request.param
    directory = zoo.ensure_family(name, tmp_path_factory.mktemp("zoo"))
    engine = LocalTrainingEngine(directory, zoo.served_name(name), device="cpu")
    rng = np.random.default_rng(0)
    data = [_datum(n, rng) for n in LENGTHS]
    engine.create_model("a", LoraSpec(rank=4, alpha=8.0, seed=1))
    engine.create_model("b", LoraSpec(rank=8, alpha=8.0, seed=2))
    engine.run_passes([_pass("a", data), _pass("b", data[:2])])
    step = AdamConfig(learning_rate=1e-2)
    engine.optim_step([OptimRequest("a", step), OptimRequest("b", step)])
    yield Family(name, engine, data)
    engine.close()


def _run(fam: Family, packed: bool) -> tuple[list[np.ndarray], list[torch.Tensor]]:
    """Logprobs of both tenants' rows and every adapter gradient, with the packed mixers or
    transformers' forward per row."""
    mixers.PACKED = packed
    try:
        out = fam.engine.run_passes([_pass("a", fam.data), _pass("b", fam.data[1:3])])
    finally:
        mixers.PACKED = True
    logprobs = [o["logprobs"] for r in out for o in r.outputs]
    return logprobs, _grads(fam.engine, "a") + _grads(fam.engine, "b")


def test_packed_mixers_equal_transformers_forward_per_row(family: Family) -> None:
    packed, per_row = _run(family, True), _run(family, False)
    for x, y in zip(packed[0], per_row[0], strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
    for g1, g2 in zip(packed[1], per_row[1], strict=True):  # summed over tokens: relative
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-5 * float(g2.abs().max()))
    assert all(bool(g.abs().sum() > 0) for g in packed[1]), "every adapter tensor is trained"


def test_a_tenant_alone_equals_packed(family: Family) -> None:
    engine, data = family.engine, family.data
    alone = engine.run_passes([_pass("a", data)])[0]
    grads_alone = _grads(engine, "a")
    packed = engine.run_passes([_pass("b", data[1:]), _pass("a", data)])[1]
    grads_packed = _grads(engine, "a")
    _grads(engine, "b")
    for x, y in zip(alone.outputs, packed.outputs, strict=True):
        np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=1e-5)
    for g1, g2 in zip(grads_alone, grads_packed, strict=True):
        torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-6)


def test_a_cpu_runs_the_reference_and_reports_it(family: Family) -> None:
    kernels = family.engine.capabilities().kernels
    scan = HybridKernel.MAMBA2_SCAN if family.name == "nemotron_h" else None
    want = {HybridKernel.SHORT_CONVOLUTION, scan or HybridKernel.GATED_DELTA_RULE}
    assert {k.kernel for k in kernels} == want
    assert all(k.implementation is KernelImpl.REFERENCE and "cpu" in k.reason for k in kernels)


# -- the choice ----------------------------------------------------------------------------

QWEN36 = Shapes(conv=(8192, 4, False, "silu"), delta=(16, 128, 32, 128))  # Qwen3.6-35B-A3B
NEMOTRON3 = Shapes(conv=(6144, 4, True, "silu"), mamba=(64, 64, 8, 128))  # Nemotron-3 Nano


def test_the_reference_runs_where_no_field_kernel_may_and_says_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decided before any device work, so a CPU machine checks a CUDA device's rules."""
    cuda = torch.device("cuda")
    caplog.set_level(logging.INFO, logger="lockstep.kernels")
    fp32 = hybrid_kernels.choose(QWEN36, cuda, torch.float32).choices
    assert [c.implementation for c in fp32] == [KernelImpl.REFERENCE] * 2
    assert all("TF32" in c.reason for c in fp32)
    assert all(r.levelname == "WARNING" for r in caplog.records)  # slow on a GPU: a warning
    assert "gated_delta_rule runs reference" in caplog.text
    monkeypatch.setattr(hybrid_kernels, "FIELD_MAMBA2_SCAN", False)
    off = hybrid_kernels.choose(NEMOTRON3, cuda, torch.bfloat16).choices
    assert off[1].reason == "switched off (hybrid_kernels.FIELD_MAMBA2_SCAN)"
    gelu = Shapes(conv=(64, 4, False, "gelu"))
    (conv,) = hybrid_kernels.choose(gelu, cuda, torch.bfloat16).choices
    assert conv.implementation is KernelImpl.REFERENCE and "'gelu'" in conv.reason
    if not FLA:
        missing = hybrid_kernels.choose(QWEN36, cuda, torch.bfloat16).choices
        assert all("fla does not import: ModuleNotFoundError" in c.reason for c in missing)
    caplog.clear()
    hybrid_kernels.choose(QWEN36, torch.device("cpu"), torch.float32)
    assert caplog.records and all(r.levelname == "INFO" for r in caplog.records)


class _StandInFla:
    """A stand-in for fla's kernels (fla runs on CUDA only): the reference on the inputs as
    given (bf16), or, `leaky`, run over the whole packed sequence as ONE row, as a varlen
    kernel that ignores its row bounds would."""

    version = "stand-in"

    def __init__(self, leaky: bool) -> None:
        self.leaky = leaky

    def _rows(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not self.leaky:
            return args
        total = sum(args[-1].widths)
        return (*args[:-1], Packing((0,), (total,), (total,)))

    def short_convolution(self, *args: Any) -> torch.Tensor:
        return hybrid_reference.short_convolution(*self._rows(args))

    def gated_delta_rule(self, *args: Any) -> torch.Tensor:
        return hybrid_reference.gated_delta_rule(*self._rows(args))

    def mamba2_scan(self, *args: Any) -> torch.Tensor:
        return hybrid_reference.mamba2_scan(*self._rows(args))


@pytest.mark.parametrize("kernel", list(HybridKernel))
def test_the_self_check_passes_a_right_kernel_and_refuses_a_leaky_one(
    kernel: HybridKernel, monkeypatch: pytest.MonkeyPatch
) -> None:
    shapes = Shapes(conv=(48, 4, True, "silu"), delta=(2, 16, 4, 16), mamba=(4, 16, 2, 16))
    cpu = torch.device("cpu")
    for leaky in (False, True):
        monkeypatch.setattr(hybrid_field, "load", lambda leaky=leaky: _StandInFla(leaky))
        hybrid_kernels.self_check.cache_clear()
        try:
            passed, why = hybrid_kernels.self_check(kernel, shapes, cpu, torch.bfloat16)
        finally:
            hybrid_kernels.self_check.cache_clear()
        assert passed is not leaky, why
        assert ("self-check passed" if passed else "failed its self-check") in why


# -- fla's kernels against the reference ---------------------------------------------------


@pytest.mark.skipif(
    os.environ.get("LOCKSTEP_SKIP_FLA_INTERPRETER") == "1",
    reason="LOCKSTEP_SKIP_FLA_INTERPRETER=1: fla's kernels are NOT checked on this CPU",
)
def test_fla_equals_the_reference_in_tritons_interpreter() -> None:
    """fla's three kernels (the releases the GPU runs) in Triton's interpreter, fp32: output and
    every input gradient within 1e-5 relative RMS of the reference (measured: ~1e-7)."""
    packages = overlay(INTERPRETER / "requirements.txt", "fla-interpreter")
    root = INTERPRETER.parents[1]
    env = {**os.environ, "PYTHONPATH": f"{packages}{os.pathsep}{root}", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, str(INTERPRETER / "check.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["fla"] == "0.6.0"
    for kernel in HybridKernel:
        for layout, errors in result[kernel.value].items():
            assert len(errors) >= 4 and max(errors.values()) <= 1e-5, (kernel, layout, errors)


UNTESTED = (
    "fla's kernels (gated delta rule, short convolution, simple GLA as Mamba-2's scan) are NOT "
    "checked against the reference, nor the hybrid families trained with them; run this file "
    "on a GPU with fla installed (benchmarks/gpu_prepare.sh carries its wheels)"
)
needs_fla = pytest.mark.skipif(
    not (CUDA and FLA),
    reason=("no CUDA device here: " if not CUDA else "fla is not installed: ") + UNTESTED,
)


@needs_fla
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("kernel", "shapes"),
    [
        (HybridKernel.SHORT_CONVOLUTION, QWEN36),
        (HybridKernel.GATED_DELTA_RULE, QWEN36),
        (HybridKernel.SHORT_CONVOLUTION, NEMOTRON3),
        (HybridKernel.MAMBA2_SCAN, NEMOTRON3),
    ],
)
def test_fla_equals_the_reference_at_production_shapes(
    kernel: HybridKernel, shapes: Shapes, dtype: torch.dtype
) -> None:
    fla = hybrid_field.load()
    lengths = (1000, 37, 2048, 8, 515)  # several chunks, one shorter than the conv, uneven
    errors = hybrid_kernels.compare(kernel, shapes, fla, torch.device("cuda"), dtype, lengths)
    worst = max(e for _, e in errors)
    assert worst <= hybrid_kernels.TOLERANCE[dtype], errors


@needs_fla
@pytest.mark.parametrize("name", HYBRID)
def test_every_hybrid_family_trains_with_fla_on_cuda(name: str, tmp_path: Path) -> None:
    """bf16 on CUDA: fla chosen for every kernel (imported, self-check passed), the packed
    logprobs within bf16 rounding of transformers' forward per row, a tenant alone == packed."""
    directory = zoo.ensure_family(name, tmp_path)
    engine = LocalTrainingEngine(directory, zoo.served_name(name), device="cuda", dtype="bfloat16")
    try:
        kernels = engine.capabilities().kernels
        assert all(k.implementation is KernelImpl.FLA for k in kernels), kernels
        rng = np.random.default_rng(0)
        fam = Family(name, engine, [_datum(n, rng) for n in LENGTHS])
        engine.create_model("a", LoraSpec(rank=4, alpha=8.0, seed=1))
        engine.create_model("b", LoraSpec(rank=8, alpha=8.0, seed=2))
        packed, per_row = _run(fam, True), _run(fam, False)
        for x, y in zip(packed[0], per_row[0], strict=True):
            np.testing.assert_allclose(x, y, rtol=0, atol=5e-2)
        alone = engine.run_passes([_pass("a", fam.data)])[0].outputs
        together = engine.run_passes([_pass("b", fam.data[1:]), _pass("a", fam.data)])[1].outputs
        for x, y in zip(alone, together, strict=True):
            np.testing.assert_allclose(x["logprobs"], y["logprobs"], rtol=0, atol=2e-2)
    finally:
        engine.close()
