"""`--engine` and the Megatron flags, shared by `lockstep serve` and the scheduler process."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from lockstep.workers.megatron.parallel import ParallelConfig


@dataclass(frozen=True)
class EngineOptions:
    engine: str = "local"  # "local" | "megatron"
    parallel: ParallelConfig = ParallelConfig()
    ray_address: str | None = None  # None: start a local Ray runtime
    micro_batch: int = 8  # rows per pipeline micro-batch

    def argv(self) -> list[str]:
        """The flags that reproduce these options in the scheduler process."""
        p = self.parallel
        out = ["--engine", self.engine, "--tp", str(p.tp), "--pp", str(p.pp), "--cp", str(p.cp),
               "--dp", str(p.dp), "--micro-batch", str(self.micro_batch)]
        if p.sequence_parallel:
            out.append("--sequence-parallel")
        if self.ray_address:
            out += ["--ray-address", self.ray_address]
        return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training engine")
    g.add_argument("--engine", choices=["local", "megatron"], default="local",
                   help="local: one torch process; megatron: megatron-core ranks on Ray")
    for axis, what in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("dp", "data")):
        g.add_argument(f"--{axis}", type=int, default=1,
                       help=f"{what} parallel size (--engine megatron)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="megatron sequence parallel (needs Transformer Engine)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster for the megatron ranks (default: a local Ray runtime)")
    g.add_argument("--micro-batch", type=int, default=8,
                   help="rows per pipeline micro-batch (--engine megatron)")


def from_args(a: argparse.Namespace) -> EngineOptions:
    """Raises ValueError naming the flag (bad sizes; cp / sequence parallel without TE)."""
    parallel = ParallelConfig(tp=a.tp, pp=a.pp, cp=a.cp, dp=a.dp,
                              sequence_parallel=a.sequence_parallel)
    if a.engine == "local" and (parallel.world_size > 1 or parallel.sequence_parallel):
        raise ValueError("--tp/--pp/--cp/--dp/--sequence-parallel need --engine megatron")
    if a.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {a.micro_batch}")
    if a.engine == "megatron":
        parallel.check_backend()
    return EngineOptions(a.engine, parallel, a.ray_address, a.micro_batch)
