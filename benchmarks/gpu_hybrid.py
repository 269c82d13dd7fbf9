"""The hybrid kernels at production shape, for `gpu_suite.py` (section `hybrid_kernels`): each
field kernel (fla, `lockstep/modeling/hybrid_field.py`) against the PyTorch reference
(`hybrid_reference.py`) on one packed micro-batch, forward + backward.

  qwen3_6   Qwen3.6-35B-A3B's linear attention: 16 key heads x 128, 32 value heads x 128, short
            convolution of width 4 over q | k | v (8192 channels, no bias, silu)
  nemotron3 Nemotron-3 Nano 30B-A3B's Mamba-2: 64 heads x 64, 8 groups, state 128, convolution
            of width 4 over x | B | C (6144 channels, with bias, silu), chunks of 128

Per kernel: the largest relative RMS error of its output and input gradients against the
reference computed in float32 (the load-time self-check's measure, on longer rows), within
`hybrid_kernels.TOLERANCE` or not, both implementations' seconds per call on the same bf16 inputs,
the speed-up and the peak memory each adds; and what the engine's load-time choice picks on this
device (`hybrid_kernels.choose`, the self-check included). Rows: 8192 tokens in uneven rows (one
of 8 tokens, several chunks long ones). Without fla (a CPU smoke run) only the reference is timed,
at tiny shapes, and the section says why.
"""

from __future__ import annotations

import statistics
from typing import Any, cast

import torch
from gpu_kernels import _time

from lockstep.engine.capabilities import HybridKernel
from lockstep.modeling import hybrid_field, hybrid_kernels
from lockstep.modeling.hybrid_kernels import Shapes

PRODUCTION = {
    "qwen3_6": Shapes(conv=(8192, 4, False, "silu"), delta=(16, 128, 32, 128)),
    "nemotron3": Shapes(conv=(6144, 4, True, "silu"), mamba=(64, 64, 8, 128)),
}
SMOKE = {
    "qwen3_6": Shapes(conv=(96, 4, False, "silu"), delta=(2, 16, 4, 16)),
    "nemotron3": Shapes(conv=(192, 4, True, "silu"), mamba=(4, 16, 2, 32)),
}
ROWS = (2048, 1500, 8, 2048, 600, 1988)  # 8192 tokens, uneven, several 64-token chunks each
SMOKE_ROWS = (40, 8, 72)


def hybrid_kernels_section(device: str, smoke: bool, reps: int) -> dict[str, Any]:
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shapes, lengths = (SMOKE, SMOKE_ROWS) if smoke else (PRODUCTION, ROWS)
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "rows": list(lengths)}
    try:
        fla: Any = hybrid_field.load()
        out["fla"] = fla.version
    except Exception as exc:  # no fla here: time the reference alone
        fla, out["fla"] = None, f"does not import: {exc!r}"
    for model, shape in shapes.items():
        chosen = hybrid_kernels.choose(shape, dev, dtype).choices
        out[model] = {
            "choice": {c.kernel.value: [c.implementation.value, c.reason] for c in chosen}
        }
        for kernel in shape.kernels():
            out[model][kernel.value] = _kernel(kernel, shape, fla, dev, dtype, lengths, reps)
    return out


def _kernel(
    kernel: HybridKernel,
    shapes: Shapes,
    fla: Any,
    device: torch.device,
    dtype: torch.dtype,
    lengths: tuple[int, ...],
    reps: int,
) -> dict[str, Any]:
    gen = torch.Generator(device=device).manual_seed(0)
    field = cast(hybrid_field.Fla, fla if fla is not None else _NoField())  # duck-typed
    inputs, ours, reference = hybrid_kernels.case(kernel, shapes, field, lengths, gen, dtype)
    result: dict[str, Any] = {}
    if fla is not None:
        errors = hybrid_kernels.compare(kernel, shapes, fla, device, dtype, lengths)
        worst = max(e for _, e in errors)
        tolerance = hybrid_kernels.TOLERANCE.get(dtype)
        result["relative_rms_errors"] = dict(errors)
        result["within_tolerance"] = tolerance is not None and worst <= tolerance
        result["tolerance"] = tolerance
    impls = {"reference": reference} if fla is None else {"field": ours, "reference": reference}
    for name, fn in impls.items():
        leaves = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}

        def step(fn: Any = fn, leaves: dict[str, torch.Tensor] = leaves) -> None:
            for leaf in leaves.values():
                leaf.grad = None
            fn(**leaves).float().square().mean().backward()

        times, peak = _time(step, device.type, reps)
        result[f"{name}_s"], result[f"{name}_peak_extra_gb"] = times, peak
    if fla is not None:
        ratio = statistics.median(result["reference_s"]) / statistics.median(result["field_s"])
        result["field_speedup"] = ratio
    return result


class _NoField:
    """Stands in for fla where it does not import: its calls are never made."""

    version = "absent"

    def __getattr__(self, name: str) -> Any:
        def absent(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"fla is not installed: no field {name}")

        return absent
