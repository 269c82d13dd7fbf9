"""What one rank of a Megatron worker group does.

Every rank receives the same calls with the same arguments (the engine broadcasts them); each
keeps only its share: its TP shard of its PP stage, and its DP slice of the batch's rows. Only
global rank 0 returns results (the rest return None).

- `run_passes`: the cycle's rows are ordered by length, split over DP, cut into micro-batches of
  `micro_batch` rows each padded to its own longest row, and run with megatron's pipeline
  schedule (1F1B when PP > 1, shapes sent along: variable_seq_lengths). Losses are token sums
  computed by the shared torch losses on the last stage from vocab-parallel logprobs
  (`logprobs.py`: the logits stay split over TP; positions go in the local engine's chunks).
- `optim_step`: DP-sum each tenant's adapter grads, take the global grad norm over TP x PP, clip,
  then the same batched AdamW as the local engine, on this rank's shards only.
- `gather_adapter` / `set_adapter`: adapters (and Adam moments) travel unsharded in PEFT keys;
  ranks slice their shards on the way in and rank 0 merges them on the way out.
- MoE (EP > 1): the experts' all-to-alls pair up the DP replicas of an EP group, so every
  replica runs the same number of micro-batches (all-padding ones where it has fewer rows);
  expert grads sum over the expert-data-parallel group, and their norm over the EP group.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockstep.engine.types import (
    Datum,
    LoraSpec,
    OptimRequest,
    PassPart,
    PassRequest,
    PassResult,
)
from lockstep.training.logprobs import chunk_tokens, target_logprobs
from lockstep.training.losses import datum_targets, loss_from_logprobs
from lockstep.training.optim import AdamGroup, AdamState, batched_adamw_step
from lockstep.workers.megatron.convert import load_stage
from lockstep.workers.megatron.logprobs import vocab_parallel_logprobs
from lockstep.workers.megatron.lora import MegatronLora, ParamInfo, merge_experts, merge_shards
from lockstep.workers.megatron.model import HFArch, build_stage
from lockstep.workers.megatron.parallel import ParallelConfig, init_parallel, shutdown_parallel

PAD_MULTIPLE = 8  # as the local engine: padded length is a multiple of 8


@dataclass
class _Row:
    request: int
    index: int  # datum index within its request
    datum: Datum
    length: int
    model_id: str


@dataclass
class _MicroBatch:
    rows: list[_Row | None]  # None: padding row (no adapter, no loss)
    tokens: torch.Tensor  # [rows, seq]


def _load_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


class RankWorker:
    def __init__(
        self,
        model_dir: str,
        parallel: ParallelConfig,
        rank: int,
        master_addr: str,
        master_port: int,
        micro_batch: int = 8,
    ) -> None:
        from megatron.core import parallel_state as ps

        init_parallel(parallel, rank, master_addr, master_port)
        self.parallel = parallel
        self.rank = rank
        self.micro_batch = micro_batch
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.edp_rank = ps.get_expert_data_parallel_rank()
        self.first = ps.is_pipeline_first_stage()
        self.last = ps.is_pipeline_last_stage()
        self.arch = arch = HFArch.from_dir(Path(model_dir))
        parallel.check_model(
            arch.layers, arch.heads, arch.kv_heads, arch.vocab, arch.intermediate, arch.experts
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
        model = build_stage(
            arch, parallel.tp, parallel.pp, parallel.cp, parallel.sequence_parallel, parallel.ep
        )
        load_stage(
            model,
            _load_hf_weights(Path(model_dir)),
            arch,
            parallel.tp,
            self.tp_rank,
            parallel.pp,
            self.pp_rank,
            parallel.ep,
            self.ep_rank,
        )
        self.model = model.to(self.device)
        self.lora = MegatronLora(
            self.model, arch, parallel.tp, self.tp_rank, parallel.ep, self.ep_rank
        )
        self.chunk = chunk_tokens(arch.vocab // parallel.tp)
        self.adam: dict[str, AdamState] = {}
        # A request run in parts: this rank's grads of its model before its FIRST part.
        self._undo: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {}
        # Added (as exact zeros) to a stage output that no adapter touched, so the schedule's
        # backward has a graph on every stage even when a tenant trains only the LM head.
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)

    def ping(self) -> int:
        return self.rank

    def device_memory(self) -> tuple[int, int]:
        """(free, total) bytes of this rank's device after load; (0, 0) off CUDA."""
        if self.device.type != "cuda":
            return 0, 0
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def close(self) -> None:
        shutdown_parallel()

    # -- adapters -------------------------------------------------------------------------

    def set_adapter(
        self,
        aid: str,
        state: dict[str, torch.Tensor],
        spec: LoraSpec,
        moments: dict[str, torch.Tensor] | None,
        step: int,
    ) -> None:
        """Create or replace `aid` from its full PEFT state (+ full Adam moments, if any)."""
        self.lora.load_adapter(aid, state, spec)
        self._undo.pop(aid, None)
        adam = AdamState(step=step)
        if moments:
            for _, info in self.lora.params(aid):
                adam.exp_avg.append(self._shard(moments[f"{info.key}.exp_avg"], info))
                adam.exp_avg_sq.append(self._shard(moments[f"{info.key}.exp_avg_sq"], info))
        self.adam[aid] = adam

    def _shard(self, full: torch.Tensor, info: ParamInfo) -> torch.Tensor:
        if info.experts:
            full = torch.chunk(full, self.parallel.ep)[self.ep_rank]
        elif info.cat_dim is not None:
            full = torch.chunk(full, self.parallel.tp, dim=info.cat_dim)[self.tp_rank]
        return full.to(self.device, torch.float32).contiguous().clone()

    def delete_adapter(self, aid: str) -> None:
        self.lora.remove_adapter(aid)
        self.adam.pop(aid, None)
        self._undo.pop(aid, None)

    def undo_parts(self, aid: str) -> None:
        """Restore `aid`'s grads kept at its FIRST part (`TrainingEngine.undo_parts`)."""
        for p, grad in self._undo.pop(aid, []):
            p.grad = None if grad is None else grad.clone()

    def gather_adapter(self, aid: str, include_optimizer: bool) -> Any:
        """Rank 0: (full PEFT state, full moments or None, Adam step); others: None. Dense
        tensors come from DP replica 0 (one rank per TP shard), experts from expert-DP replica 0
        (one rank per EP shard)."""
        adam = self.adam[aid]
        owned = [
            (n, p, info)
            for n, (p, info) in enumerate(self.lora.params(aid))
            if (self.edp_rank if info.experts else self.dp_rank) == 0
        ]
        mine = None
        if owned:
            kinds: list[tuple[str, list[torch.Tensor] | None]] = [("", None)]
            if include_optimizer and adam.exp_avg:
                kinds += [(".exp_avg", adam.exp_avg), (".exp_avg_sq", adam.exp_avg_sq)]
            tensors = [
                [
                    (
                        (p if ms is None else ms[n]).detach().cpu(),
                        dataclasses.replace(info, key=info.key + suffix),
                    )
                    for n, p, info in owned
                ]
                for suffix, ms in kinds
            ]
            mine = (self.pp_rank, self.tp_rank, self.ep_rank, tensors, adam.step)
        parts = self._gather(mine)
        if parts is None:
            return None
        parts = [p for p in parts if p is not None]
        merged: list[dict[str, torch.Tensor]] = [{}, {}, {}]  # state, exp_avg, exp_avg_sq
        for stage in range(self.parallel.pp):
            here = [p for p in parts if p[0] == stage]
            # Dense tensors: one shard per TP rank; experts: one per EP rank; in rank order.
            for experts, rank_of, merge in ((False, 1, merge_shards), (True, 2, merge_experts)):
                shards = [
                    [[t for t in kind if t[1].experts == experts] for kind in p[3]]
                    for p in sorted(here, key=operator.itemgetter(rank_of))
                ]
                shards = [s for s in shards if s[0]]
                for k in range(len(shards[0]) if shards else 0):
                    merged[k] |= merge([s[k] for s in shards])
        step = max(p[4] for p in parts)
        moments = merged[1] | merged[2] if include_optimizer else None
        return merged[0], moments, step

    def _gather(self, obj: Any) -> list[Any] | None:
        world = self.parallel.world_size
        out: list[Any] | None = [None] * world if self.rank == 0 else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out

    # -- passes ---------------------------------------------------------------------------

    def run_passes(
        self, requests: list[PassRequest], configs: list[dict[str, float]]
    ) -> list[PassResult] | None:
        outs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]] = {}
        train = [i for i, r in enumerate(requests) if not r.forward_only]
        evals = [i for i, r in enumerate(requests) if r.forward_only]
        for i in train:  # a part is its model's only request in the call
            if requests[i].part is PassPart.FIRST:
                aid = requests[i].model_id
                params = [p for p, _ in self.lora.params(aid)]
                self._undo[aid] = [(p, None if p.grad is None else p.grad.clone()) for p in params]
        if train:
            self._schedule(requests, train, configs, outs, forward_only=False)
        for i in train:
            if requests[i].part is PassPart.LAST:
                self._undo.pop(requests[i].model_id, None)
        if evals:
            with torch.no_grad():
                self._schedule(requests, evals, configs, outs, forward_only=True)
        mine = outs if self.last and self.tp_rank == 0 else {}
        parts = self._gather(mine)
        if parts is None:
            return None
        merged: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]] = {}
        for part in parts:
            merged |= part
        results = []
        for i, req in enumerate(requests):
            per = [merged[(i, j)] for j in range(len(req.data))]
            total = torch.tensor([p[2] for p in per], dtype=torch.float32).sum()
            results.append(
                PassResult(
                    request_id=req.request_id,
                    outputs=[{"logprobs": p[0], "elementwise_loss": p[1]} for p in per],
                    metrics={"loss:sum": float(total)},
                )
            )
        return results

    def _schedule(
        self,
        requests: list[PassRequest],
        indices: list[int],
        configs: list[dict[str, float]],
        outs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]],
        forward_only: bool,
    ) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows = [
            _Row(i, j, d, int(np.asarray(d.tokens).shape[0]), requests[i].model_id)
            for i in indices
            for j, d in enumerate(requests[i].data)
        ]
        # Longest first, so each micro-batch pads only to its own longest row (as the local
        # engine); with PP > 1 the schedule then sends each micro-batch's shape along.
        rows.sort(key=lambda r: -r.length)
        dp, k = self.parallel.dp, self.dp_rank
        share = [len(rows[i * len(rows) // dp : (i + 1) * len(rows) // dp]) for i in range(dp)]
        mine = rows[k * len(rows) // dp : (k + 1) * len(rows) // dp]  # this replica's rows
        count = -(-len(mine) // self.micro_batch)
        if self.parallel.ep > 1:  # the experts' all-to-alls pair up every replica's passes
            count = max(-(-n // self.micro_batch) for n in share)
        if not count:
            return
        mbs = max(1, min(self.micro_batch, len(mine)))
        batches = []
        for start in range(0, count * mbs, mbs):
            chunk: list[_Row | None] = list(mine[start : start + mbs])
            chunk += [None] * (mbs - len(chunk))  # p2p needs equal micro-batch sizes
            longest = max((r.length for r in chunk if r is not None), default=1)
            seq = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
            tokens = torch.zeros(mbs, seq, dtype=torch.long)
            for b, row in enumerate(chunk):
                if row is not None:
                    tokens[b, : row.length] = torch.from_numpy(
                        np.asarray(row.datum.tokens, np.int64)
                    )
            batches.append(_MicroBatch(chunk, tokens.to(self.device)))
        self.model.config.variable_seq_lengths = self.parallel.pp > 1

        def forward_step(data_iterator: Any, model: Any) -> Any:
            mb: _MicroBatch = next(data_iterator)
            seq = mb.tokens.shape[1]
            positions = torch.arange(seq, device=self.device).expand(mbs, seq)
            mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=self.device), 1)
            with self.lora.route([None if r is None else r.model_id for r in mb.rows]):
                output = model(mb.tokens, positions, mask[None, None])  # True = masked: causal
            if not forward_only and not output.requires_grad:
                output = output + self._anchor
            return output, functools.partial(self._loss, mb, requests, configs, outs)

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=self.model,
            num_microbatches=len(batches),
            seq_length=batches[0].tokens.shape[1],  # the longest; per micro-batch with PP > 1
            micro_batch_size=mbs,
            forward_only=forward_only,
        )

    def _loss(
        self,
        mb: _MicroBatch,
        requests: list[PassRequest],
        configs: list[dict[str, float]],
        outs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]],
        logits: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        sums = []
        for b, row in enumerate(mb.rows):
            if row is None:
                continue
            req = requests[row.request]
            targets = datum_targets(row.datum, logits.device)
            # Vocab-parallel, in the local engine's position chunks: this rank's logits shard
            # is log-softmaxed against TP-reduced statistics, never gathered.
            logp = target_logprobs(
                logits[b, : row.length], targets, _identity, self.chunk, vocab_parallel_logprobs
            )
            logp, loss = loss_from_logprobs(logp, row.datum, req.loss_fn, configs[row.request])
            total = loss.sum()
            sums.append(total)
            outs[(row.request, row.index)] = (_np(logp), _np(loss), float(total.detach()))
        # An all-padding micro-batch (EP > 1) still backpropagates, as zeros, through the
        # experts' all-to-alls its peers wait on.
        loss_sum = torch.stack(sums).sum() if sums else logits.sum() * 0.0
        tokens = torch.tensor(sum(r.length for r in mb.rows if r is not None), dtype=torch.int)
        return loss_sum, tokens, {}

    # -- optimizer ------------------------------------------------------------------------

    @torch.no_grad()
    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]] | None:
        from megatron.core import parallel_state as ps

        dist = torch.distributed
        tenants = [r.model_id for r in requests]
        params = {t: self.lora.params(t) for t in tenants}
        # A tenant steps when ANY replica has its grads (rows go to one DP replica only).
        has = torch.tensor([float(any(p.grad is not None for p, _ in params[t])) for t in tenants])
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        live = [t for t, h in zip(tenants, has.tolist(), strict=True) if h > 0]
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for t in live:
            for p, info in params[t]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                (experts if info.experts else dense).append(p.grad)
        # Dense grads sum over the DP replicas, expert grads over the ranks holding the same
        # experts (the tokens they saw came from disjoint rows or TP shares).
        _all_reduce(dense, ps.get_data_parallel_group(), self.parallel.dp)
        edp = ps.get_expert_data_parallel_world_size()
        _all_reduce(experts, ps.get_expert_data_parallel_group(), edp)
        # Global norm per tenant: TP shards add up, TP-replicated tensors count once; experts
        # add up over the EP group (whole over TP: counted on TP rank 0).
        sq = torch.zeros(len(tenants), dtype=torch.float64)
        sq_experts = torch.zeros(len(tenants), dtype=torch.float64)
        for n, t in enumerate(tenants):
            for p, info in params[t] if t in live else []:
                if info.experts:
                    sq_experts[n] += float((_grad(p).double() ** 2).sum())
                elif info.cat_dim is not None or self.tp_rank == 0:
                    sq[n] += float((_grad(p).double() ** 2).sum())
        if self.parallel.ep > 1:
            dist.all_reduce(sq_experts, group=ps.get_expert_model_parallel_group())
        if self.tp_rank == 0:
            sq += sq_experts
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norms = sq.sqrt().tolist()
        groups, group_norms = [], []
        for n, req in enumerate(requests):
            t = req.model_id
            if t not in live:
                continue
            plist = [p for p, _ in params[t]]
            if not plist:
                self.adam[t].step += 1  # this stage holds none of its layers: count the step
            groups.append(AdamGroup(plist, self.adam[t], req.adam))
            group_norms.append(norms[n])
        # Clipped with the global (TP x PP) norm, by the same rule as the local engine.
        batched_adamw_step(groups, group_norms)
        if self.rank != 0:
            return None
        return {
            req.model_id: {
                "grad_norm:mean": norms[n] if req.model_id in live else 0.0,
                "learning_rate:mean": req.adam.learning_rate,
                "step:max": float(self.adam[req.model_id].step),
            }
            for n, req in enumerate(requests)
        }


def _all_reduce(grads: list[torch.Tensor], group: Any, size: int) -> None:
    """Sum `grads` over `group` (of `size` ranks) in one flat all-reduce."""
    if size <= 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # filled with zeros for every live tenant
    return p.grad


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()
