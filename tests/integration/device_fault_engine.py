"""FAULT INJECTION: the arithmetic FAKE training engine with a CUDA context that breaks.

A pass holding the poison token raises what torch raises for a device-side assert (the real
class, `torch.AcceleratorError`, and message); from then on every call of the engine raises it
again, as every call on a real poisoned CUDA context does. Runs in a real child process
(`ProcessTrainingEngine`), so the host's handling of device errors is what is tested.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.integration.arithmetic_engine import ArithmeticTrainingEngine

# What torch 2.x prints for an out-of-range index on a GPU.
DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
)


class DeviceFaultEngine(ArithmeticTrainingEngine):
    def __init__(self, directory: Path, poison_token: int) -> None:
        super().__init__(directory)
        self.device_poison = poison_token
        self.context_broken = False

    def _check_alive(self) -> None:
        if self.context_broken:
            raise torch.AcceleratorError(DEVICE_ASSERT)
        super()._check_alive()

    def run_passes(self, requests):  # type: ignore[no-untyped-def]
        self._check_alive()
        if any(self.device_poison in d.tokens for r in requests for d in r.data):
            self.context_broken = True
            raise torch.AcceleratorError(DEVICE_ASSERT)
        return super().run_passes(requests)
