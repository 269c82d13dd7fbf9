"""The parallel axes of a Megatron worker group, named in one place.

`ParallelConfig` says how many ranks split each axis (tensor, pipeline, context, data);
`init_parallel(...)` is the one function that applies it to a process: torch.distributed, then
megatron's process groups, then the RNG tracker megatron's attention needs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

TE_MISSING = (
    "needs NVIDIA Transformer Engine, which is not installed: megatron-core runs context "
    "parallel only in TEDotProductAttention and sequence parallel only with TE norms/linears"
)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1  # tensor parallel: splits heads, MLP columns and the vocabulary
    pp: int = 1  # pipeline parallel: splits the layers into stages
    cp: int = 1  # context parallel: splits the sequence (Transformer Engine only)
    dp: int = 1  # data parallel: splits the rows of a cycle's batch
    sequence_parallel: bool = False  # Transformer Engine only

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "cp", "dp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{axis} must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def check_model(self, num_layers: int, num_heads: int, num_kv_heads: int, vocab: int,
                    intermediate: int) -> None:
        """Refuse splits the model cannot take, naming the flag."""
        if num_layers % self.pp:
            raise ValueError(f"--pp {self.pp} must divide the model's {num_layers} layers")
        for what, n in (("attention heads", num_heads), ("key/value heads", num_kv_heads),
                        ("vocabulary entries", vocab), ("MLP columns", intermediate)):
            if n % self.tp:
                raise ValueError(f"--tp {self.tp} must divide the model's {n} {what}")

    def check_backend(self) -> None:
        """cp > 1 and sequence parallel need Transformer Engine: fail at startup, clearly."""
        wanted = [flag for flag, on in (("--cp", self.cp > 1),
                                         ("--sequence-parallel", self.sequence_parallel)) if on]
        if wanted and not has_transformer_engine():
            raise ValueError(f"{' and '.join(wanted)} {TE_MISSING}")


def has_transformer_engine() -> bool:
    try:
        import transformer_engine  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def init_parallel(cfg: ParallelConfig, rank: int, master_addr: str, master_port: int,
                  seed: int = 0) -> None:
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
