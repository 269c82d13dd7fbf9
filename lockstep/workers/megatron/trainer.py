"""MegatronTrainingEngine: the TrainingEngine interface over a worker group of megatron ranks.

The engine (in the scheduler's trainer process) validates every request, owns checkpoint file
I/O (the same PEFT + Adam layout as the local engine, unsharded, so checkpoints move between
engines and parallel layouts), and broadcasts each verb to every rank; rank 0 answers.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Literal

import torch

from lockstep.engine import memory
from lockstep.engine.capabilities import TrainerCapabilities
from lockstep.engine.families import ModelConfig
from lockstep.engine.interface import TrainingEngine
from lockstep.engine.pass_checks import check_passes, require_model
from lockstep.engine.types import (
    LoraSpec,
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassPart,
    PassRequest,
    PassResult,
)
from lockstep.errors import UserInputError
from lockstep.modeling.architecture import describe_dir
from lockstep.modeling.lora import (
    PEFT_PREFIX,
    check_adapter_state,
    dense_spec_of,
    init_adapter_state,
    validate_spec,
)
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.training import checkpoint
from lockstep.training.logprobs import chunk_tokens
from lockstep.training.optim import AdamState
from lockstep.workers.megatron.group import ProcessWorkerGroup, RayWorkerGroup, WorkerGroup
from lockstep.workers.megatron.lora import MegatronLora
from lockstep.workers.megatron.model import HFArch
from lockstep.workers.megatron.parallel import ParallelConfig

log = logging.getLogger("lockstep.megatron")
Launcher = Literal["ray", "process"]


class MegatronTrainingEngine(TrainingEngine):
    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        parallel: ParallelConfig,
        launcher: Launcher = "ray",
        ray_address: str | None = None,
        micro_batch: int = 8,
        ray_placement: str = "PACK",
        memory_budget_bytes: int = 0,
    ) -> None:
        self._shape = describe_dir(Path(model_dir)).shape  # the one description of the model
        self._arch = arch = HFArch.from_shape(self._shape, ModelConfig.read(model_dir).text)
        parallel.check_model(
            arch.layers, arch.heads, arch.kv_heads, arch.vocab, arch.intermediate, arch.experts
        )
        parallel.check_backend()
        self._card = ModelCard.from_dir(model_dir, served_name)
        self.parallel = parallel
        self._specs: dict[str, LoraSpec] = {}
        self._parted: set[str] = set()  # models whose ranks keep an undo point (run_passes)
        log.info(
            "starting megatron worker group tp=%d pp=%d cp=%d dp=%d via %s",
            parallel.tp,
            parallel.pp,
            parallel.cp,
            parallel.dp,
            launcher,
        )
        self._group: WorkerGroup
        if launcher == "ray":
            self._group = RayWorkerGroup(
                str(model_dir), parallel, micro_batch, ray_address, placement=ray_placement
            )
        else:
            self._group = ProcessWorkerGroup(str(model_dir), parallel, micro_batch)
        self._memory = self._find_budget(micro_batch, memory_budget_bytes)
        log.info(
            "megatron: memory budget %s per rank fits rows of up to %d tokens",
            memory.describe(self._memory),
            self._memory.max_row_tokens,
        )

    def _find_budget(self, micro_batch: int, configured: int) -> MemoryBudget:
        """One rank's share of a pass: layers / pp, heads, MLP and vocab / tp; `micro_batch`
        rows padded to the longest, pp micro-batches in flight (1F1B), fp32, and the local
        layer spec's unfused attention (scores kept in every layer)."""
        p = self.parallel
        vocab = self._arch.vocab // p.tp
        one = memory.PassCost.from_shape(
            self._shape.shard(p.tp, p.pp), 4, False, 1, chunk_tokens(vocab), True
        )
        rows = micro_batch * p.pp
        cost = dataclasses.replace(
            one,
            per_token=one.per_token * rows,
            scores_per_token_sq=one.scores_per_token_sq * rows,
        )
        devices = [tuple(m) for m in self._group.call("device_memory")]
        if all(total > 0 for _, total in devices):
            free, total = min(devices)
            budget, source = memory.cuda_budget(free, total, configured)
        else:
            budget, source = memory.cpu_budget(configured)
        return cost.budget(budget, self._card.max_context_length, source)

    # -- models ---------------------------------------------------------------------------

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> TrainerCapabilities:
        # No server-side custom losses: its pipeline schedule carries no per-datum metrics yet
        # (admission refuses them by name and the SDK runs them client-side). Text only.
        return TrainerCapabilities("megatron", custom_loss=False)

    def memory_budget(self) -> MemoryBudget:
        return self._memory

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        try:
            validate_spec(spec)
        except ValueError as exc:
            raise UserInputError("lora_config", str(exc)) from exc
        state = init_adapter_state(spec, MegatronLora.spec_paths(self._arch, spec))
        self._group.call("set_adapter", model_id, state, spec, None, 0)
        self._specs[model_id] = spec
        self._parted.discard(model_id)

    def delete_model(self, model_id: str) -> None:
        self._parted.discard(model_id)
        if self._specs.pop(model_id, None) is not None:
            self._group.call("delete_adapter", model_id)

    def has_model(self, model_id: str) -> bool:
        return model_id in self._specs

    # -- passes and steps -----------------------------------------------------------------

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        configs = check_passes(self, requests, self._parted)
        for req in requests:  # the ranks keep its undo point before it runs (rank_worker)
            if req.part is PassPart.FIRST and not req.forward_only:
                self._parted.add(req.model_id)
        results: list[PassResult] = self._group.call("run_passes", requests, configs)[0]
        for req in requests:
            if req.part is PassPart.LAST:
                self._parted.discard(req.model_id)
        return results

    def undo_parts(self, model_id: str) -> None:
        if model_id in self._parted:
            self._group.call("undo_parts", model_id)
            self._parted.discard(model_id)

    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        for req in requests:
            require_model(self, req.model_id)
        metrics: dict[str, dict[str, float]] = self._group.call("optim_step", requests)[0]
        return metrics

    # -- checkpoints ----------------------------------------------------------------------

    def _names(self, spec: LoraSpec) -> list[str]:
        return [
            f"{PEFT_PREFIX}{p}.lora_{ab}.weight"
            for p in MegatronLora.spec_paths(self._arch, spec)
            for ab in ("A", "B")
        ]

    def _gather(
        self, model_id: str, include_optimizer: bool
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None, int]:
        state, moments, step = self._group.call("gather_adapter", model_id, include_optimizer)[0]
        return state, moments, step

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        require_model(self, model_id)
        spec = self._specs[model_id]
        state, moments, step = self._gather(model_id, include_optimizer)
        names = self._names(spec)
        adam = None
        if include_optimizer:
            adam = AdamState(step=step)
            if moments:
                adam.exp_avg = [moments[f"{n}.exp_avg"] for n in names]
                adam.exp_avg_sq = [moments[f"{n}.exp_avg_sq"] for n in names]
        return checkpoint.write_state(Path(directory), state, names, spec, self._card.name, adam)

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        adapter = checkpoint.read_adapter(Path(directory), self._card.name)
        state = adapter.state
        spec = adapter.spec or dense_spec_of(state, adapter.rank, adapter.alpha)
        try:
            check_adapter_state(state, spec, MegatronLora.spec_paths(self._arch, spec))
        except ValueError as exc:
            raise UserInputError("path", f"checkpoint does not fit this base model: {exc}") from exc
        moments, step = None, 0
        if include_optimizer:
            names = self._names(spec)
            adam = checkpoint.read_adam(Path(directory), names, [state[n] for n in names])
            step = adam.step
            if adam.exp_avg:
                moments = {f"{n}.exp_avg": m for n, m in zip(names, adam.exp_avg, strict=True)}
                moments |= {
                    f"{n}.exp_avg_sq": v for n, v in zip(names, adam.exp_avg_sq, strict=True)
                }
        self._group.call("set_adapter", model_id, state, spec, moments, step)
        self._specs[model_id] = spec
        self._parted.discard(model_id)
        return spec

    def export_adapter(self, model_id: str, directory: Path) -> int:
        require_model(self, model_id)
        state, _, _ = self._gather(model_id, False)
        return save_peft_adapter(Path(directory), state, self._specs[model_id], self._card.name)

    def close(self) -> None:
        self._group.close()
