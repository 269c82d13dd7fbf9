"""Which sampling engine the scheduler runs, and the flags that choose it.

`lockstep serve --sampler local|vllm|sglang` (Lockstep starts the engine and owns its process)
or `--sampler-url URL` (attach to an engine someone else runs; the kind says which API it speaks).
The same flags are forwarded to `python -m lockstep.scheduler`, which calls `start_sampler`.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lockstep.engine.interface import SamplingEngine

SamplerKind = Literal["local", "vllm", "sglang"]


@dataclass(frozen=True)
class SamplerConfig:
    kind: SamplerKind = "local"
    url: str | None = None  # attach to a running vLLM / SGLang server instead of starting one
    max_adapters: int = 64  # adapters resident in the sampler at once (LRU beyond)
    colocate: bool = False  # release the sampler's memory around each training phase
    vllm_python: Path | None = None  # python of a venv with vllm; None: the cached one
    sglang_python: Path | None = None  # python of a venv with sglang; None: this python
    max_lora_rank: int = 64  # what the vLLM / SGLang server reserves for each adapter

    def __post_init__(self) -> None:
        if self.max_adapters < 1:
            raise ValueError(f"--max-adapters must be >= 1, got {self.max_adapters}")
        if self.url is not None and self.kind == "local":
            raise ValueError("--sampler-url needs --sampler vllm or --sampler sglang (the API "
                             "the server speaks)")

    def argv(self) -> list[str]:
        """The same choice as `python -m lockstep.scheduler` flags."""
        out = ["--sampler", self.kind, "--max-adapters", str(self.max_adapters),
               "--max-lora-rank", str(self.max_lora_rank)]
        if self.url:
            out += ["--sampler-url", self.url]
        if self.colocate:
            out.append("--colocate")
        if self.vllm_python:
            out += ["--vllm-python", str(self.vllm_python)]
        if self.sglang_python:
            out += ["--sglang-python", str(self.sglang_python)]
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling engine")
    g.add_argument("--sampler", choices=["local", "vllm", "sglang"], default="local",
                   help="local: the built-in torch sampler; vllm / sglang: start and supervise "
                   "that server (or attach with --sampler-url)")
    g.add_argument("--sampler-url", default=None, metavar="URL",
                   help="attach to a running vLLM / SGLang server instead of starting one")
    g.add_argument("--max-adapters", type=int, default=None,
                   help="LoRA adapters resident in the sampler at once; the least recently used "
                   "is evicted and reloaded on demand (default: 64 local, 4 vllm/sglang)")
    g.add_argument("--max-lora-rank", type=int, default=64,
                   help="largest adapter rank the vLLM / SGLang server accepts (with those "
                   "samplers, also the largest rank a training run may ask for)")
    g.add_argument("--colocate", action="store_true",
                   help="trainer and sampler share one accelerator: the sampler releases its "
                   "memory before each training phase and resumes after it")
    g.add_argument("--vllm-python", type=Path, default=None,
                   help="python of a venv with vllm (default: build/reuse "
                   "~/.cache/lockstep-vllm-venv-*)")
    g.add_argument("--sglang-python", type=Path, default=None,
                   help="python of a venv with sglang (default: this python)")


def from_args(a: argparse.Namespace) -> SamplerConfig:
    url = a.sampler_url
    kind: SamplerKind = a.sampler
    max_adapters = a.max_adapters if a.max_adapters is not None else (
        64 if kind == "local" else 4)
    return SamplerConfig(kind=kind, url=url, max_adapters=max_adapters, colocate=a.colocate,
                         vllm_python=a.vllm_python, sglang_python=a.sglang_python,
                         max_lora_rank=a.max_lora_rank)


def start_sampler(cfg: SamplerConfig, model_dir: Path, served_name: str,
                  data_dir: Path) -> SamplingEngine:
    """Build the configured sampling engine (this may start a server and wait for it)."""
    logs = data_dir / "logs"
    if cfg.kind == "vllm":
        from lockstep.rollout.vllm import VllmLaunchConfig, VllmSamplingEngine
        from lockstep.rollout.vllm.environment import ensure_vllm_python

        if cfg.url:
            return VllmSamplingEngine.attach(cfg.url, model_dir, served_name, cfg.max_adapters)
        return VllmSamplingEngine.launch(VllmLaunchConfig(
            python=cfg.vllm_python or ensure_vllm_python(), model_dir=model_dir,
            served_name=served_name, max_loras=cfg.max_adapters, max_lora_rank=cfg.max_lora_rank,
            # vLLM's sleep mode exists for CUDA/ROCm only; the CPU build refuses the flag.
            sleep_mode=cfg.colocate and _has_gpu(), log_file=logs / "vllm.log"))
    if cfg.kind == "sglang":
        import sys

        from lockstep.rollout.sglang import SglangLaunchConfig, SglangSamplingEngine

        if cfg.url:
            return SglangSamplingEngine.attach(cfg.url, model_dir, served_name,
                                               cfg.max_adapters)
        return SglangSamplingEngine.launch(SglangLaunchConfig(
            python=cfg.sglang_python or Path(sys.executable), model_dir=model_dir,
            served_name=served_name, max_loras=cfg.max_adapters, max_lora_rank=cfg.max_lora_rank,
            memory_saver=cfg.colocate, log_file=logs / "sglang.log"))
    from lockstep.rollout.local import LocalSamplingEngine
    from lockstep.workers.process import ProcessSamplingEngine

    return ProcessSamplingEngine(
        functools.partial(LocalSamplingEngine, model_dir, served_name, cfg.max_adapters),
        "sampler")


def _has_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()
