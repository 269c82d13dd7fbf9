"""The ONE place where megatron-core is taught to run on CPU (gloo) — nothing else patches it.

megatron-core assumes CUDA in a few spots that CPU tests (and CPU serving) reach:

1. RNG: attention always enters `get_cuda_rng_tracker().fork()`, and
   `model_parallel_cuda_manual_seed` seeds through `torch.cuda.manual_seed`. On CPU both are
   mapped to the CPU generator (`torch.{get,set}_rng_state`, `torch.manual_seed`); dropout is 0 in
   our configs, so the tracked states never change any number.
2. `torch.cuda.current_device()` / `synchronize()` / `current_stream()`: p2p communication
   allocates receive buffers on `current_device()`; on CPU that is "cpu".
3. `pipeline_parallel/schedules.py` allocates its token counter with `device="cuda"`, and
   `transformer/utils.py` the sliding-window mask of the local attention: these modules see a
   `torch` whose `zeros` / `ones` map a CUDA device to the CPU.
4. The MoE all-to-all dispatcher makes a side `torch.cuda.Stream()` for its device-to-host copies
   and syncs on an event of it: on CPU a stream whose waits and events do nothing; its
   device-to-host helper hands split sizes to the all-to-all as numpy arrays only for CUDA
   tensors, and gloo's all_to_all takes sequences, not tensors: CPU tensors become numpy too.

`apply()` is idempotent and does nothing when CUDA is available, so GPU runs use megatron as is
-- except for one fix that any machine without Transformer Engine needs: megatron's MoE router
gating tests `te_general_gemm is not None`, a name its failed TE import never defined (it is set
to None, so the router takes its plain torch.mm path).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch

_applied = False


def _cpu_device(device: Any) -> Any:
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


class _CpuAllocTorch(types.ModuleType):
    """`torch`, except that `zeros` / `ones(..., device="cuda")` allocate on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return torch.zeros(*args, **kwargs)

    @staticmethod
    def ones(*args: Any, **kwargs: Any) -> torch.Tensor:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return torch.ones(*args, **kwargs)


class _CpuEvent:
    def synchronize(self) -> None:
        pass


class _CpuStream:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()


def _to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def apply() -> None:
    """Install the CPU shims (no-op with CUDA, and on the second call)."""
    global _applied
    if _applied:
        return
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if torch.cuda.is_available():
        _applied = True
        return
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer import utils as transformer_utils
    from megatron.core.transformer.moe import token_dispatcher

    def get_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> Any:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    mp_random._get_cuda_rng_state = get_state
    mp_random._set_cuda_rng_state = set_state
    cuda: Any = torch.cuda
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda new_state, device="cuda": torch.set_rng_state(new_state)
    cuda.manual_seed = lambda seed: None  # the CPU generator is seeded by torch.manual_seed
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda device=None: None
    cuda.current_stream = lambda device=None: None
    cuda.Stream = _CpuStream
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    schedules.torch = _CpuAllocTorch()
    transformer_utils.torch = _CpuAllocTorch()
    token_dispatcher.maybe_move_tensor_to_cpu = _to_host
    _applied = True
