"""Build the sampling engine the config names (`SamplerConfig`, lockstep/config/sections.py).

`lockstep serve --sampler local|vllm|sglang` (Lockstep starts the engine and owns its process)
or `--sampler-url URL` (attach to an engine someone else runs; the kind says which API it speaks).
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

from lockstep.config import SamplerConfig
from lockstep.engine import families
from lockstep.engine.interface import SamplingEngine
from lockstep.errors import UnsupportedModel
from lockstep.workers.process import NO_DEADLINE, Deadline


def check_external_family(kind: str, model_dir: Path) -> None:
    """Refuse, at configuration time, a model an external sampling engine would serve wrong
    (the model's `Architecture.external_lora`: only the dense families)."""
    from lockstep.modeling.architecture import describe_dir  # imports torch

    arch = describe_dir(model_dir)
    if not arch.external_lora:
        raise UnsupportedModel(
            f"--sampler {kind} does not serve LoRA adapters of {arch.model_type!r} models the "
            f"way Lockstep trains them (supported: {', '.join(sorted(families.EXTERNAL_LORA))}); "
            "use --sampler local, which samples every family the trainer accepts"
        )


def start_sampler(
    cfg: SamplerConfig,
    model_dir: Path,
    served_name: str,
    data_dir: Path,
    deadline: Deadline = NO_DEADLINE,
    after: Future[None] | None = None,
) -> SamplingEngine:
    """Build the configured sampling engine (this may start a server and wait for it).

    `after` (the local sampler): its process starts at once and loads the model only once
    `after` is done (the trainer is up; if that fails, so does this)."""
    logs = data_dir / "logs"
    slots = cfg.resident_adapters
    if cfg.kind != "local":
        check_external_family(cfg.kind, model_dir)
    if cfg.kind == "vllm":
        from lockstep.rollout.vllm import VllmLaunchConfig, VllmSamplingEngine
        from lockstep.rollout.vllm.environment import ensure_vllm_python

        if cfg.url:
            return VllmSamplingEngine.attach(cfg.url, model_dir, served_name, slots)
        return VllmSamplingEngine.launch(
            VllmLaunchConfig(
                python=cfg.vllm_python or ensure_vllm_python(),
                model_dir=model_dir,
                served_name=served_name,
                max_loras=slots,
                max_lora_rank=cfg.max_lora_rank,
                # vLLM's sleep mode exists for CUDA/ROCm only; the CPU build refuses the flag.
                sleep_mode=cfg.colocate and _has_gpu(),
                log_file=logs / "vllm.log",
            )
        )
    if cfg.kind == "sglang":
        import sys

        from lockstep.rollout.sglang import SglangLaunchConfig, SglangSamplingEngine

        if cfg.url:
            return SglangSamplingEngine.attach(cfg.url, model_dir, served_name, slots)
        return SglangSamplingEngine.launch(
            SglangLaunchConfig(
                python=cfg.sglang_python or Path(sys.executable),
                model_dir=model_dir,
                served_name=served_name,
                max_loras=slots,
                max_lora_rank=cfg.max_lora_rank,
                memory_saver=cfg.colocate,
                log_file=logs / "sglang.log",
            )
        )
    from lockstep.workers.process import NamedFactory, ProcessSamplingEngine

    local = NamedFactory(  # named, not imported: the sampler's process loads torch
        "lockstep.rollout.local:LocalSamplingEngine",
        (model_dir, served_name, slots),
        {"dtype": None if cfg.dtype == "auto" else cfg.dtype, "decode": cfg.decode},
    )
    return ProcessSamplingEngine(local, "sampler", deadline, after)


def _has_gpu() -> bool:
    return Path("/dev/nvidiactl").exists() or Path("/dev/kfd").exists()
