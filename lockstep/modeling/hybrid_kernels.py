"""Which implementation computes each hybrid kernel, decided once per process and device.

The hybrid families' recurrent layers (`mixers.py`) call three kernels: the gated delta rule
(Gated DeltaNet), the short causal convolution before it and before Mamba-2's scan, and Mamba-2's
chunked scan. Each runs the field's kernel (`hybrid_field`: flash-linear-attention's Triton
kernels, rows kept apart by `cu_seqlens`) where that kernel
- may run at all: a CUDA device and 16-bit weights (its products run in TF32 on float32 inputs,
  where Lockstep keeps float32 exact: `loader.load_base_model` turns TF32 off);
- imports; and
- passes a self-check on the device at load: tiny random inputs of the model's own head shapes,
  three rows of unequal lengths in one varlen call, its output and every input gradient equal to
  the reference's (computed in float32 from the same inputs) within `TOLERANCE` relative RMS
  error (fla's own tests use 0.5-2 %; a wrong kernel is off by O(1)).
Otherwise the reference runs (`hybrid_reference`: transformers' algorithm vectorised over rows),
announced: a warning on CUDA (an info line on a CPU, where it is simply what runs), the engine's
capabilities (`KernelChoice`, reported by `get_info` and the server's capabilities) and the
`lockstep_hybrid_kernel` metric.

One switch per kernel (`FIELD_*`, read at load and at every call) forces the reference, so the
GPU suite compares both on one engine.

The local sampler runs transformers' own layers, whose kernels transformers picks by what is
installed (`fla` for the delta rule, `causal-conv1d`, `mamba-ssm`): `in_transformers` reports
that choice, and refuses a field kernel transformers would use that fails the self-check here.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lockstep.engine.capabilities import HybridKernel, KernelChoice, KernelImpl
from lockstep.engine.interface import is_device_error
from lockstep.errors import UnsupportedModel
from lockstep.modeling import hybrid_field, hybrid_reference
from lockstep.modeling.packing import Packing

log = logging.getLogger("lockstep.kernels")

# True: the field's kernel where it was chosen at load; False: the reference (benchmarks).
FIELD_GATED_DELTA_RULE = True
FIELD_SHORT_CONVOLUTION = True
FIELD_MAMBA2_SCAN = True

# Largest relative RMS error (||field - reference|| / ||reference||) of the self-check, per
# dtype the field kernels run in.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
SELF_CHECK_ROWS = (40, 24, 72)  # three rows of unequal lengths, one not a whole 64-token chunk


def switched_on(kernel: HybridKernel) -> bool:
    return {
        HybridKernel.GATED_DELTA_RULE: FIELD_GATED_DELTA_RULE,
        HybridKernel.SHORT_CONVOLUTION: FIELD_SHORT_CONVOLUTION,
        HybridKernel.MAMBA2_SCAN: FIELD_MAMBA2_SCAN,
    }[kernel]


@dataclass(frozen=True)
class Shapes:
    """The head shapes a model's hybrid layers call the kernels with (its first layer's of
    each kind): what the self-check runs. None: the model has no such layer."""

    conv: tuple[int, int, bool, str | None] | None = None  # channels, width, bias, activation
    delta: tuple[int, int, int, int] | None = None  # key heads, key dim, value heads, value dim
    mamba: tuple[int, int, int, int] | None = None  # heads, head dim, groups, state size

    def kernels(self) -> tuple[HybridKernel, ...]:
        used = (
            (HybridKernel.SHORT_CONVOLUTION, self.conv),
            (HybridKernel.GATED_DELTA_RULE, self.delta),
            (HybridKernel.MAMBA2_SCAN, self.mamba),
        )
        return tuple(k for k, shape in used if shape is not None)


class Kernels:
    """What a model's packed recurrent layers call: per kernel, the implementation chosen at
    load, unless its switch is off now."""

    def __init__(self, choices: tuple[KernelChoice, ...]) -> None:
        self.choices = choices
        self._field = {c.kernel for c in choices if c.implementation is KernelImpl.FLA}
        self._fla = hybrid_field.load() if self._field else None

    def _uses_field(self, kernel: HybridKernel) -> hybrid_field.Fla | None:
        return self._fla if kernel in self._field and switched_on(kernel) else None

    def short_convolution(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        activation: str | None,
        rows: Packing,
    ) -> torch.Tensor:
        fla = self._uses_field(HybridKernel.SHORT_CONVOLUTION)
        impl = hybrid_reference.short_convolution if fla is None else fla.short_convolution
        return impl(x, weight, bias, activation, rows)

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        rows: Packing,
    ) -> torch.Tensor:
        fla = self._uses_field(HybridKernel.GATED_DELTA_RULE)
        impl = hybrid_reference.gated_delta_rule if fla is None else fla.gated_delta_rule
        return impl(q, k, v, g, beta, rows)

    def mamba2_scan(
        self,
        x: torch.Tensor,
        dt: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        dt_bias: torch.Tensor,
        dt_limit: tuple[float, float],
        chunk: int,
        rows: Packing,
    ) -> torch.Tensor:
        fla = self._uses_field(HybridKernel.MAMBA2_SCAN)
        impl = hybrid_reference.mamba2_scan if fla is None else fla.mamba2_scan
        return impl(x, dt, a, b, c, d, dt_bias, dt_limit, chunk, rows)


def choose(shapes: Shapes, device: torch.device, dtype: torch.dtype) -> Kernels:
    """The implementation of every kernel `shapes` uses on `device` with `dtype` weights,
    announced (logged here; the caller reports the choices in its capabilities)."""
    choices = tuple(_choice(k, shapes, device, dtype) for k in shapes.kernels())
    announce(choices, device, "trainer")
    return Kernels(choices)


def announce(choices: tuple[KernelChoice, ...], device: torch.device, engine: str) -> None:
    for c in choices:
        slow = c.implementation is KernelImpl.REFERENCE and device.type == "cuda"
        log.log(
            logging.WARNING if slow else logging.INFO,
            "%s: hybrid kernel %s runs %s%s: %s",
            engine,
            c.kernel.value,
            c.implementation.value,
            " (PyTorch, much slower than the field's kernel)" if slow else "",
            c.reason,
        )


def _choice(
    kernel: HybridKernel, shapes: Shapes, device: torch.device, dtype: torch.dtype
) -> KernelChoice:
    def reference(why: str) -> KernelChoice:
        return KernelChoice(kernel, KernelImpl.REFERENCE, why)

    if not switched_on(kernel):
        return reference(f"switched off (hybrid_kernels.FIELD_{kernel.name})")
    if device.type != "cuda":
        return reference(f"the field's kernels are Triton kernels for CUDA; this is {device}")
    if dtype not in TOLERANCE:
        return reference(
            f"{dtype} weights: fla multiplies float32 in TF32, and Lockstep keeps float32 exact"
        )
    if kernel is HybridKernel.SHORT_CONVOLUTION and shapes.conv is not None:
        activation = shapes.conv[3]
        if activation not in hybrid_field.ACTIVATIONS:
            return reference(f"activation {activation!r}: fla's convolution computes silu only")
    passed, why = self_check(kernel, shapes, device, dtype)
    return KernelChoice(kernel, KernelImpl.FLA, why) if passed else reference(why)


@functools.cache
def self_check(
    kernel: HybridKernel, shapes: Shapes, device: torch.device, dtype: torch.dtype
) -> tuple[bool, str]:
    """Whether fla's `kernel` equals the reference on `device` with `dtype` inputs, and the
    result in words (the choice's reason). Once per process and case."""
    try:
        fla = hybrid_field.load()
    except Exception as exc:  # not installed, no Triton, a Triton that does not fit the driver
        return False, f"fla does not import: {exc!r}"
    try:
        errors = compare(kernel, shapes, fla, device, dtype, SELF_CHECK_ROWS)
    except Exception as exc:  # a kernel that fails to compile or launch here
        if is_device_error(exc):  # the device is unusable now: the engine cannot start
            raise
        return False, f"fla {fla.version} failed its self-check on {device}: {exc!r}"
    tolerance = TOLERANCE[dtype]
    failing = [(what, error) for what, error in errors if not error <= tolerance]  # NaN too
    if failing:
        what, error = failing[0]
        return False, (
            f"fla {fla.version} failed its self-check on {device} ({dtype}): {what} is "
            f"{error:.2e} off the reference (relative RMS), over {tolerance}"
        )
    worst = max(error for _, error in errors)
    return True, (
        f"fla {fla.version}: self-check passed on {device} ({dtype}): output and gradients "
        f"within {worst:.1e} of the reference (relative RMS; tolerance {tolerance})"
    )


def compare(
    kernel: HybridKernel,
    shapes: Shapes,
    field: hybrid_field.Fla,
    device: torch.device,
    dtype: torch.dtype,
    lengths: tuple[int, ...],
) -> list[tuple[str, float]]:
    """(what, relative RMS error against the reference) of `field`'s `kernel` on random inputs
    of `shapes` in rows of `lengths`: its output and each input's gradient."""
    gen = torch.Generator(device=device).manual_seed(0)
    inputs, ours, reference = case(kernel, shapes, field, lengths, gen, dtype)
    return _compare(inputs, ours, reference, gen)


def rows(lengths: tuple[int, ...]) -> Packing:
    """The packing of rows of `lengths` back to back (no padding)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return Packing(tuple(starts), lengths, lengths)


Fn = Callable[..., torch.Tensor]


def case(
    kernel: HybridKernel,
    shapes: Shapes,
    fla: hybrid_field.Fla,
    lengths: tuple[int, ...],
    gen: torch.Generator,
    dtype: torch.dtype,
) -> tuple[dict[str, torch.Tensor], Fn, Fn]:
    """Random `dtype` inputs of the model's shapes for `kernel` in rows of `lengths` (drawn from
    `gen`, on its device), and the field's and the reference's call on them."""
    packed = rows(lengths)
    t, device = sum(lengths), gen.device

    def rand(*shape: int, scale: float = 1.0, kind: torch.dtype = dtype) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * scale
        return x.to(kind)

    if kernel is HybridKernel.SHORT_CONVOLUTION:
        assert shapes.conv is not None
        channels, width, bias, act = shapes.conv
        inputs = {"x": rand(1, t, channels), "weight": rand(channels, width, scale=0.5)}
        if bias:
            inputs["bias"] = rand(channels, scale=0.1)

        def conv(impl: Fn) -> Fn:
            return lambda x, weight, bias=None: impl(x, weight, bias, act, packed)

        return inputs, conv(fla.short_convolution), conv(hybrid_reference.short_convolution)
    if kernel is HybridKernel.GATED_DELTA_RULE:
        assert shapes.delta is not None
        hk, dk, hv, dv = shapes.delta
        inputs = {
            "q": rand(1, t, hk, dk),
            "k": rand(1, t, hk, dk),
            "v": rand(1, t, hv, dv),
            "g": torch.nn.functional.logsigmoid(rand(1, t, hv, kind=torch.float32) + 3.0),
            "beta": rand(1, t, hv).sigmoid(),
        }

        def delta(impl: Fn) -> Fn:
            return lambda q, k, v, g, beta: impl(q, k, v, g, beta, packed)

        return inputs, delta(fla.gated_delta_rule), delta(hybrid_reference.gated_delta_rule)
    assert shapes.mamba is not None
    heads, head_dim, groups, state = shapes.mamba
    a = -torch.linspace(1.0, 16.0, heads, device=device)  # as Mamba-2's init: -(1 .. heads)
    d, dt_bias = torch.ones(heads, device=device, dtype=dtype), rand(heads, scale=0.5)
    inputs = {
        "x": rand(1, t, heads, head_dim),
        "dt": rand(1, t, heads, scale=0.5) - 2.0,
        "b": rand(1, t, groups, state),
        "c": rand(1, t, groups, state),
    }

    def scan(impl: Fn) -> Fn:
        return lambda x, dt, b, c: impl(x, dt, a, b, c, d, dt_bias, (0.0, float("inf")), 64, packed)

    return inputs, scan(fla.mamba2_scan), scan(hybrid_reference.mamba2_scan)


def _compare(
    inputs: dict[str, torch.Tensor], field: Fn, reference: Fn, gen: torch.Generator
) -> list[tuple[str, float]]:
    """(what, relative RMS error) of the output and of each input's gradient: the field kernel
    on the inputs as they are, the reference on their float32 copies."""
    ours = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    theirs = {k: v.detach().float().requires_grad_() for k, v in inputs.items()}
    out, ref = field(**ours), reference(**theirs)
    upstream = torch.randn(ref.shape, generator=gen, device=ref.device, dtype=torch.float32)
    out.backward(upstream.to(out.dtype))
    ref.backward(upstream)
    errors = [("output", _relative(out, ref))]
    for name in inputs:
        grad, want = ours[name].grad, theirs[name].grad
        assert grad is not None and want is not None
        errors.append((f"d{name}", _relative(grad, want)))
    return errors


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.detach().float()
    scale = want.pow(2).mean().sqrt().clamp_min(1e-12)
    return float((got.detach().float() - want).pow(2).mean().sqrt() / scale)


# -- the sampler: transformers' own layers -------------------------------------------------

# The package transformers takes each kernel from when it imports (its
# `use_kernel_func_from_hub_with_fallback` in 5.17 .. 5.24), and the module it imports.
TRANSFORMERS_PACKAGES = {
    HybridKernel.GATED_DELTA_RULE: (KernelImpl.FLA, "fla.ops.gated_delta_rule"),
    HybridKernel.SHORT_CONVOLUTION: (KernelImpl.CAUSAL_CONV1D, "causal_conv1d"),
    HybridKernel.MAMBA2_SCAN: (KernelImpl.MAMBA_SSM, "mamba_ssm.ops.triton.ssd_combined"),
}


def in_transformers(
    shapes: Shapes, device: torch.device, dtype: torch.dtype
) -> tuple[KernelChoice, ...]:
    """What transformers' own layers run for each kernel `shapes` uses (the local sampler),
    announced; raises UnsupportedModel where it would run fla's kernel that fails its
    self-check on this device."""
    choices = []
    for kernel in shapes.kernels():
        impl, module = TRANSFORMERS_PACKAGES[kernel]
        try:
            importlib.import_module(module)
        except Exception as exc:
            why = f"transformers' choice: {impl.value} does not import ({exc!r})"
            choices.append(KernelChoice(kernel, KernelImpl.REFERENCE, why))
            continue
        why = f"transformers' choice: {impl.value} imports"
        if impl is KernelImpl.FLA and device.type == "cuda" and dtype in TOLERANCE:
            passed, why = self_check(kernel, shapes, device, dtype)
            if not passed:
                raise UnsupportedModel(
                    f"transformers would run fla's {kernel.value} in the sampler, and {why}; "
                    "uninstall flash-linear-attention and fla-core, or install a release that "
                    "passes"
                )
        choices.append(KernelChoice(kernel, impl, why))
    result = tuple(choices)
    announce(result, device, "sampler")
    return result
