"""One `gpu_suite.py` run's settings, clock, results and the helpers every section shares."""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_models import SHAPES, SMOKE, Shape, build_model
from rich.console import Console

console = Console(width=150, log_path=False)


class Run:
    """The run's settings, its clock, its results and where they go."""

    def __init__(self, args: argparse.Namespace, device: str) -> None:
        self.args, self.device = args, device
        self.smoke, self.quick = args.smoke, args.quick
        self.start = time.perf_counter()
        self.budget = args.budget or (1e9 if self.smoke else 170.0 if self.quick else 300.0)
        self.reps = 1 if self.smoke else 2 if self.quick else 3
        self.tenants = 2 if self.smoke else 8
        self.warm = 0 if self.smoke else 1  # untimed warm-up reps (the smoke run times none)
        # bf16 base weights on the GPU (the CUDA default); fp32 on a CPU smoke run, where bf16
        # GEMMs take slow paths
        self.dtype = "bfloat16" if device == "cuda" else "float32"
        self.datums, self.length = (2, 32) if self.smoke else (4, 512)
        self.small_length = 16 if self.smoke else 256
        self.micro_batch_tokens = 256 if self.smoke else 8192
        self.out = Path(args.out)
        self.results: dict[str, Any] = {"sections": {}}
        self.profiles: list[str] = []
        self.models: dict[str, Path] = {}
        self.adapters: dict[str, Path] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-suite-"))

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def out_of_time(self) -> bool:
        """Past the budget but for a margin: measuring loops stop after their first sample."""
        return self.left() < 20

    def rate(self) -> float | None:
        """The measured bf16 matmul FLOP/s (the `device` section's), the MFU denominator."""
        value = self.results["sections"].get("device", {}).get("matmul_bf16_flops_per_s")
        return float(value) if value else None

    def datasheet(self) -> float | None:
        value = self.results["sections"].get("device", {}).get("datasheet_bf16_flops_per_s")
        return float(value) if value else None

    def shape(self, family: str) -> Shape:
        if self.smoke:
            return SMOKE[family]
        layers = {"dense": 8, "moe": 2, "hybrid": 4}.get(family) if self.quick else None
        shape = SHAPES[family]
        return shape.with_layers(layers) if layers else shape

    def model(self, family: str) -> Path:
        """The family's model directory, built on first use (kept for its other sections)."""
        if family not in self.models:
            directory = self.tmp / family
            shape = self.shape(family)
            console.log(f"{family}: building {shape.title} x {shape.layers} layers")
            build_model(directory, shape, self.device)
            self.models[family] = directory
        return self.models[family]

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{self.args.name}.json"
        path.write_text(json.dumps(self.results, indent=2, default=_plain) + "\n")
        if self.profiles:
            (self.out / f"{self.args.name}_profile.txt").write_text("\n\n".join(self.profiles))


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor | np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


def release(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return fn()
    except Exception as exc:
        return {"error": repr(exc), "traceback": traceback.format_exc(limit=6)}
