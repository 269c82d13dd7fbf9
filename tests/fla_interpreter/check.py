"""fla's kernels against the reference in Triton's interpreter (a CPU, float32), as
tests/unit/test_hybrid_kernels.py runs them: `python check.py` with this directory's packages on
PYTHONPATH prints, per kernel and row layout, the relative RMS error of the output and every
input gradient (`hybrid_kernels.compare`, the load-time self-check's measure) as JSON.

Two adaptations of the interpreter, not of fla's arithmetic:
- autotuning times configs on a device: only each kernel's first config is kept;
- fla's chunk loops call `.to()` on their induction variable (`for i_t in range(NT)`), which
  compiled Triton makes a tensor and the interpreter leaves a Python int: the kernel modules'
  `range` yields ints that also answer `.to()` with the interpreter's scalar tensor.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import autotuner  # noqa: E402
from triton.runtime.interpreter import TensorHandle  # noqa: E402

_prune = autotuner.Autotuner.prune_configs
autotuner.Autotuner.prune_configs = lambda self, *a, **k: _prune(self, *a, **k)[:1]

_NUMPY = {tl.int64: np.int64, tl.int32: np.int32}


class _Index(int):
    def to(self, dtype: Any, **_: Any) -> Any:
        return tl.core.tensor(TensorHandle(np.array(int(self), dtype=_NUMPY[dtype]), dtype), dtype)


def _int(x: Any) -> int:
    return int(np.asarray(x.handle.data).reshape(-1)[0]) if isinstance(x, tl.core.tensor) else x


def _range(*args: Any) -> Iterator[_Index]:
    for i in builtins.range(*(_int(a) for a in args)):
        yield _Index(i)


def main() -> None:
    import fla.modules.causal_conv1d  # noqa: F401
    import fla.ops.gated_delta_rule  # noqa: F401
    import fla.ops.simple_gla  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith(("fla.ops", "fla.modules")) and module is not None:
            module.range = _range  # type: ignore[attr-defined]

    from lockstep.engine.capabilities import HybridKernel
    from lockstep.modeling import hybrid_field, hybrid_kernels
    from lockstep.modeling.hybrid_kernels import Shapes

    fla = hybrid_field.load()
    # Grouped heads (2 key heads for 4 value heads; 2 Mamba groups for 4 heads), a conv bias.
    shapes = Shapes(conv=(48, 4, True, "silu"), delta=(2, 16, 4, 16), mamba=(4, 16, 2, 16))
    layouts = {"40,24,72": (40, 24, 72), "8,136,5,64,100": (8, 136, 5, 64, 100)}
    out: dict[str, Any] = {"fla": fla.version}
    for kernel in HybridKernel:
        out[kernel.value] = {
            name: dict(
                hybrid_kernels.compare(
                    kernel, shapes, fla, torch.device("cpu"), torch.float32, lengths
                )
            )
            for name, lengths in layouts.items()
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
