"""Apply the parallel axes of a Megatron worker group to a process.

`ParallelConfig` (lockstep/config/training.py, where its flags are) says how many ranks split
each axis (tensor, pipeline, context, data); `init_parallel(...)` is the one function that
applies it: torch.distributed, then megatron's process groups, then the RNG tracker megatron's
attention needs.
"""

from __future__ import annotations

import os

import torch

from lockstep.config import ParallelConfig

__all__ = ["ParallelConfig", "init_parallel", "shutdown_parallel"]


def init_parallel(
    cfg: ParallelConfig, rank: int, master_addr: str, master_port: int, seed: int = 0
) -> None:
    """Join the process group (`rank` of `cfg.world_size`) and build megatron's groups."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from lockstep.workers.megatron import cuda_shims

    cfg.check_backend()
    cuda_shims.apply()
    os.environ["MASTER_ADDR"] = master_addr
    os.environ["MASTER_PORT"] = str(master_port)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend, rank=rank, world_size=cfg.world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=1,  # whole experts (model.py)
        create_gloo_process_groups=backend == "gloo",
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def shutdown_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
