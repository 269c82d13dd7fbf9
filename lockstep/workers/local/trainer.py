"""The local training engine: one process, torch, CPU or one GPU, every tenant in one model.

A clock cycle is `run_passes` (the fused forward/backward of every tenant's datums) then
`optim_step` (one batched AdamW over every adapter that asked).

The fused pass orders rows by length and cuts them into micro-batches of at most
`micro_batch_tokens` tokens (`micro_batches.py`). A micro-batch is ONE packed sequence: its rows
concatenated, each padded only to a whole block of 8 tokens, positions restarting per row, and
attention run row by row on each row's own span (`modeling.attention`): no row is padded to
another's length. Each micro-batch runs forward then backward at once (gradients accumulate in
the adapters' .grad), so activations live for one micro-batch. Inside a micro-batch rows are
ordered by adapter and the LoRA routing names the adapter of each 8-token block, so each LoRA
layer takes one grouped GEMM pair over every adapter's run on CUDA, a GEMM pair per adapter's
slice of it on the CPU (`modeling.linear_lora`). Target logprobs
come from the final hidden states in token chunks through the fused LM head and log-softmax
(`training.logprobs`): full-vocabulary logits never exist beyond one chunk.

Packing never changes a tenant's numbers beyond float rounding (fp32 <= 1e-5): every op is per
row, per adapter or per token, block padding lies outside every attention span, and every matmul
sees >= 8 rows so CPU GEMM takes the same kernel class whether a tenant runs alone or packed.

That is the PACKED path, for the architectures `modeling.architecture` lists (dense, MoE, sliding
windows with sinks, MLA, Gated DeltaNet hybrids). Any other causal LM runs on the GENERIC path:
each row alone through the model's own forward (its own attention and masks), unpadded, with the
same multi-LoRA layers. A feature neither path computes exactly is refused at load, by name.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np
import torch

from lockstep.config.training import DEFAULT_MICRO_BATCH_TOKENS
from lockstep.engine import families, memory
from lockstep.engine.capabilities import (
    TEXT_AND_IMAGES,
    TEXT_INPUTS,
    KernelChoice,
    TrainerCapabilities,
)
from lockstep.engine.interface import TrainingEngine
from lockstep.engine.pass_checks import check_passes, require_model
from lockstep.engine.types import (
    Checkpointing,
    LoraSpec,
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassPart,
    PassRequest,
    PassResult,
)
from lockstep.errors import UnsupportedModel, UserInputError
from lockstep.modeling import hybrid_kernels, mixers
from lockstep.modeling.architecture import TrainerPath, check_head, describe
from lockstep.modeling.attention import ROW_ATTENTION
from lockstep.modeling.checkpointing import LayerCheckpoints
from lockstep.modeling.decoder_layers import decoder_layers
from lockstep.modeling.linear_lora import MultiLoRALinear
from lockstep.modeling.loader import default_device, load_base_model, resolve_dtype
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.vision.tower import VisionModel, decoder_inputs
from lockstep.training.logprobs import CHUNK_LOGIT_ELEMENTS, Head, LinearHead, chunk_tokens
from lockstep.training.optim import AdamGroup, AdamState, batched_adamw_step
from lockstep.training.pass_result import pass_result, row_loss
from lockstep.workers.local import adapter_io, host_memory
from lockstep.workers.local.micro_batches import alone, micro_batches, pack
from lockstep.workers.local.pass_state import PassState, Row
from lockstep.workers.snapshots import SnapshotWriter

log = logging.getLogger("lockstep.trainer")


class LocalTrainingEngine(TrainingEngine):
    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        device: torch.device | str | None = None,
        micro_batch_tokens: int = DEFAULT_MICRO_BATCH_TOKENS,
        dtype: str | None = None,
        activation_checkpointing: Checkpointing | str = Checkpointing.AUTO,
        trainer_path: TrainerPath | None = None,
        memory_budget_bytes: int = 0,
    ) -> None:
        """`trainer_path` forces a path (tests and benchmarks compare them); by default the
        architecture's: PACKED where it is proven equal to the model's own forward.
        `memory_budget_bytes`: what a pass may use (0: found after load, `engine.memory`)."""
        dev = torch.device(device) if device is not None else default_device()
        model, self._card = load_base_model(
            model_dir, served_name, dev, resolve_dtype(dtype, dev), attn_implementation=None
        )
        arch = describe(model, self._card.vision)  # refuses by name what it cannot compute
        check_head(model, self._card.vocab_size)
        if trainer_path is TrainerPath.PACKED and arch.trainer_path is not TrainerPath.PACKED:
            raise UnsupportedModel(f"{arch.model_type}: the packed path is not proven for it")
        path = TrainerPath(trainer_path or arch.trainer_path)
        self._packed = path is TrainerPath.PACKED
        self._card = dataclasses.replace(self._card, trainer_path=path)
        if self._packed:  # the language model's attention only (a vision tower keeps its own)
            text = {"text_config": ROW_ATTENTION} if self._card.vision else ROW_ATTENTION
            model.set_attn_implementation(text)
        elif arch.trainer_path is TrainerPath.GENERIC:
            log.warning(
                "trainer: %s is not a packed family (%s): every row runs alone through the "
                "model's own forward, exact but slower",
                arch.model_type,
                ", ".join(sorted(families.PACKED)),
            )
        # A vision-language model's frozen tower: the images of each micro-batch in one call.
        self._vision = None if arch.vision is None else VisionModel(model, model_dir, arch.vision)
        self._checkpointing = Checkpointing(activation_checkpointing)
        self._checkpoints = LayerCheckpoints(decoder_layers(model))
        self._model = model
        self._lora = LoraModel(model, arch)
        self._kernels: tuple[KernelChoice, ...] = ()
        recurrent = [model.get_submodule(m) for m in arch.row_mixers] if self._packed else []
        if recurrent:  # each row's state apart, every row in one call per kernel
            kernels = hybrid_kernels.choose(mixers.shapes(recurrent), dev, model.dtype)
            for module in recurrent:
                mixers.install(module, kernels, self._lora.narrowed)
            self._kernels = kernels.choices
        log.info("trainer: %s; runs the %s path", arch.summary(), path.value)
        self._decoder = model.get_decoder()
        head = model.get_output_embeddings()
        assert isinstance(head, torch.nn.Module)
        self._head = head
        # Bigger chunks on a GPU (GEMM efficiency), 64 MiB of fp32 logits on a CPU.
        self._chunk = chunk_tokens(
            self._card.vocab_size, CHUNK_LOGIT_ELEMENTS * (4 if dev.type == "cuda" else 1)
        )
        self._budget = micro_batch_tokens
        self._device: torch.device = next(model.parameters()).device
        self._adam: dict[str, AdamState] = {}
        # A request run in parts: each model's gradients before its FIRST part (its undo point).
        self._undo: dict[str, dict[torch.nn.Parameter, torch.Tensor | None]] = {}
        self._snapshots = SnapshotWriter()  # snapshots leave the cycle's critical path
        # The model's own forward (masks) builds score matrices in every attention layer; row
        # attention only where a window, sinks or a narrower value head take the math kernel.
        cost = memory.PassCost.from_shape(
            arch.shape,
            next(model.parameters()).element_size(),
            self._checkpointing is not Checkpointing.NEVER,
            micro_batch_tokens if self._packed else 1,
            self._chunk,
            generic=not self._packed,
        )
        if self._device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self._device)
            found = memory.cuda_budget(free, total, memory_budget_bytes)
        else:
            found = memory.cpu_budget(memory_budget_bytes)
        self._pass_cost = cost  # what admission assumes a pass takes (tests/unit/test_pass_cost.py)
        if self._device.type == "cpu":  # glibc's heap: memory over speed with checkpointing
            if self._checkpointing is Checkpointing.ALWAYS:
                element = next(model.parameters()).element_size()
                hidden = int(model.config.hidden_size)
                host_memory.release_big_frees(
                    host_memory.mmap_threshold(micro_batch_tokens, hidden, element)
                )
            else:
                host_memory.keep_for_next_pass(cost.micro_batch_bytes(micro_batch_tokens, 1))
        self._memory = cost.budget(found[0], self._card.max_context_length, found[1])
        if self._vision is not None:  # the tower's pass: the largest image it fits
            self._memory = self._vision.budget(self._memory, found[0], micro_batch_tokens)
        log.info(
            "trainer: memory budget %s fits rows of up to %d tokens",
            memory.describe(self._memory),
            self._memory.max_row_tokens,
        )

    # -- models ---------------------------------------------------------------------------

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> TrainerCapabilities:
        # Every built-in and custom loss; images when the model has a vision tower it runs.
        inputs = TEXT_AND_IMAGES if self._card.vision is not None else TEXT_INPUTS
        return TrainerCapabilities("local", custom_loss=True, inputs=inputs, kernels=self._kernels)

    def memory_budget(self) -> MemoryBudget:
        return self._memory

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        """Create (or re-create from scratch) an adapter with fresh Adam state."""
        try:
            self._lora.check_spec(spec)
        except ValueError as exc:
            raise UserInputError("lora_config", str(exc)) from exc
        self.delete_model(model_id)
        self._lora.add_adapter(model_id, spec)
        self._adam[model_id] = AdamState()

    def delete_model(self, model_id: str) -> None:
        self._lora.remove_adapter(model_id)
        self._adam.pop(model_id, None)
        self._undo.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        return self._lora.has_adapter(model_id)

    # -- forward / backward ---------------------------------------------------------------

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        configs = check_passes(self, requests, self._undo)
        state = PassState()
        train = [i for i, r in enumerate(requests) if not r.forward_only]
        if train:
            models = {requests[i].model_id for i in train}
            saved = {
                p: None if p.grad is None else p.grad.clone()
                for m in models
                for p in self._lora.adapter_parameters(m)
            }

            def restore(models: set[str]) -> None:  # their gradients as before the call
                for m in models:
                    for p in self._lora.adapter_parameters(m):
                        grad = saved[p]
                        p.grad = None if grad is None else grad.clone()

            pending = train
            try:
                while pending:  # again for a model whose gradient holds a failed request's rows
                    spoiled = self._fused_pass(requests, pending, configs, state, restore)
                    restore(spoiled)
                    pending = [
                        i
                        for i in train
                        if i not in state.failed and requests[i].model_id in spoiled
                    ]
            except BaseException:
                restore(models)  # a failed call leaves no gradient behind
                raise
            self._keep_undo_points([requests[i] for i in train if i not in state.failed], saved)
        # Forward-only requests run in their own no-grad forward: they never touch any grad.
        evals = [i for i, r in enumerate(requests) if r.forward_only]
        if evals:
            with torch.no_grad():
                self._fused_pass(requests, evals, configs, state, None)
        return [
            PassResult.failed(req.request_id, state.failed[i])
            if i in state.failed
            else pass_result(req, [state.outs[(i, j)] for j in range(len(req.data))])
            for i, req in enumerate(requests)
        ]

    def _keep_undo_points(
        self, succeeded: list[PassRequest], before: dict[torch.nn.Parameter, torch.Tensor | None]
    ) -> None:
        """After the call: a FIRST part that succeeded keeps its model's gradients from
        `before` it (a part is its model's only request in a call); a LAST part that succeeded
        ends its request, whose undo point goes. A part that failed keeps the undo point for
        `undo_parts`."""
        for req in succeeded:
            if req.part is PassPart.FIRST:
                params = self._lora.adapter_parameters(req.model_id)
                self._undo[req.model_id] = {p: before[p] for p in params}
            elif req.part is PassPart.LAST:
                self._undo.pop(req.model_id, None)

    def undo_parts(self, model_id: str) -> None:
        for p, grad in self._undo.pop(model_id, {}).items():
            p.grad = None if grad is None else grad.clone()

    def _fused_pass(
        self,
        requests: list[PassRequest],
        indices: list[int],
        configs: list[dict[str, float]],
        state: PassState,
        restore: Callable[[set[str]], None] | None,
    ) -> set[str]:
        """The pass of `requests[indices]` (backward too where `restore` can undo gradients);
        the models whose gradient holds rows of a request that failed after they ran.

        Out of accelerator memory (torch.OutOfMemoryError), the pass is undone and run again
        in micro-batches of half the tokens, down to one row each: rows never interact, so only
        the float rounding of the gradient sums can change. A row that does not fit alone fails
        its request, and the pass runs again without it."""
        rows = [
            Row(i, j, d, int(np.asarray(d.tokens).shape[0]), requests[i].model_id)
            for i in indices
            for j, d in enumerate(requests[i].data)
        ]
        first_seen = {m: n for n, m in reversed(list(enumerate(r.model_id for r in rows)))}
        lengths = [r.length for r in rows]
        budget = self._budget
        while True:
            cut = micro_batches(lengths, budget) if self._packed else alone(lengths)
            state.start()
            try:
                for batch in cut:
                    if all(rows[k].request in state.failed for k in batch):
                        continue  # nothing of it is wanted
                    # Rows of one adapter side by side: each LoRA layer slices, never gathers.
                    mb = sorted((rows[k] for k in batch), key=lambda r: first_seen[r.model_id])
                    self._micro_batch(mb, requests, configs, state, restore is not None)
            except torch.OutOfMemoryError as exc:
                if restore is not None:
                    restore({requests[i].model_id for i in indices})
                self._release_cached_memory()
                if all(len(b) == 1 for b in cut):
                    state.fail(rows[batch[0]], str(self._out_of_memory(rows[batch[0]])))
                    log.warning("a row ran out of memory alone: %s", exc)
                    continue
                budget //= 2
                log.warning("out of memory in a pass; retrying in micro-batches of %d", budget)
                continue
            return state.spoiled

    def _release_cached_memory(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def _out_of_memory(self, row: Row) -> UserInputError:
        """What a row that ran out of memory alone fails its request with."""
        return UserInputError(
            f"data[{row.index}].model_input",
            f"has {row.length} tokens; its pass ran out of the training engine's memory even "
            f"alone (budget {memory.describe(self._memory)}); send shorter datums",
        )

    def _micro_batch(
        self,
        rows: list[Row],
        requests: list[PassRequest],
        configs: list[dict[str, float]],
        state: PassState,
        backward: bool,
    ) -> None:
        # One packed sequence (`micro_batches.pack`); on the generic path one row, unpadded, run
        # as the model's own forward.
        seq = pack(rows, self._packed)
        starts = seq.starts
        spans = [(s, r.length, r.datum.images) for r, s in zip(rows, starts, strict=True)]
        ids, at = seq.input_ids.to(self._device), seq.positions.to(self._device)
        inputs = decoder_inputs(self._vision, ids, at, spans)  # a VLM: images, M-RoPE per row
        with (
            self._lora.row_adapters(seq.blocks),
            seq.layout(),
            self._checkpoints.only(self._checkpointed(seq.input_ids.shape[-1], rows)),
        ):
            hidden = self._decoder(**inputs, use_cache=False).last_hidden_state[0]
            terms: list[tuple[int, torch.Tensor]] = []
            for row, start in zip(rows, starts, strict=True):
                if row.request in state.failed:
                    continue  # still in the packed sequence: the others' numbers stay the same
                try:
                    out = row_loss(
                        hidden[start : start + row.length],
                        row.datum,
                        requests[row.request],
                        configs[row.request],
                        self._row_head(row.model_id),
                        self._chunk,
                    )
                except UserInputError as exc:  # this row's own data: its request fails alone
                    state.fail(row, str(exc))
                    continue
                state.outs[(row.request, row.index)] = out.detached()
                if out.backward is not None:
                    terms.append((row.request, out.backward))
            live = [t for i, t in terms if i not in state.failed]
            if backward and live:
                # d(sum)/d(loss_i) = 1: each adapter gets exactly the gradient of its own rows'
                # losses; .grad accumulates over micro-batches until optim_step. Inside the
                # routing and the checkpoint choice: checkpointed layers rerun during backward.
                torch.stack(live).sum().backward()
                state.ran(rows, {i for i, _ in terms if i not in state.failed})

    def _checkpointed(self, tokens: int, rows: list[Row]) -> Collection[int]:
        """The decoder layers a micro-batch of `tokens` packed tokens recomputes in backward."""
        if self._checkpointing is Checkpointing.NEVER:
            return ()
        if self._checkpointing is Checkpointing.ALWAYS:
            return range(self._checkpoints.count)
        longest = max(r.length for r in rows)
        budget = self._memory.budget_bytes
        return self._pass_cost.checkpoint_plan(tokens, longest, budget)

    def _row_head(self, model_id: str) -> Head | LinearHead:
        """The LM head with `model_id`'s adapter: by its parts where it is a linear layer (the
        fused logprob path, `training.logprobs`), else as a callable."""
        head = self._head
        if isinstance(head, MultiLoRALinear) and len(head.slots) == 1:
            return LinearHead(head.weight, head.bias, head.slots[0].adapter(model_id))
        if isinstance(head, torch.nn.Linear):
            return LinearHead(head.weight, head.bias)
        return functools.partial(self._call_head, model_id)

    def _call_head(self, model_id: str, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head (with `model_id`'s adapter) on one row's hidden states [c, H]."""
        with self._lora.row_adapters([model_id]):
            logits: torch.Tensor = self._head(hidden.unsqueeze(0))
        return logits.squeeze(0)

    # -- optimizer ------------------------------------------------------------------------

    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        groups = []
        for req in requests:
            require_model(self, req.model_id)
            params = self._lora.adapter_parameters(req.model_id)
            groups.append(AdamGroup(params, self._adam[req.model_id], req.adam))
        norms = batched_adamw_step(groups)
        return {
            req.model_id: {
                "grad_norm:mean": norm,
                "learning_rate:mean": req.adam.learning_rate,
                "step:max": float(self._adam[req.model_id].step),
            }
            for req, norm in zip(requests, norms, strict=True)
        }

    # -- checkpoints ----------------------------------------------------------------------

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        require_model(self, model_id)
        adam = self._adam[model_id] if include_optimizer else None
        return adapter_io.save_state(self._lora, model_id, directory, self._card.name, adam)

    def snapshot(self, model_id: str, directory: Path) -> bool:
        """Copy the adapter and Adam moments now; write them in the background."""
        require_model(self, model_id)
        write = adapter_io.copy_state(self._lora, model_id, self._card.name, self._adam[model_id])
        self._snapshots.submit(model_id, directory, write)
        return False

    def durable_snapshots(self) -> list[tuple[str, Path]]:
        return self._snapshots.durable()

    def close(self) -> None:
        self._snapshots.close()  # a clean stop finishes the snapshots already taken

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        state, spec, adam = adapter_io.read_state(
            self._lora, model_id, directory, self._card.name, include_optimizer
        )
        self._lora.load_adapter_state(model_id, state, spec)
        self._adam[model_id] = adam
        self._undo.pop(model_id, None)  # new state: a request in parts starts again
        return spec

    def export_adapter(self, model_id: str, directory: Path) -> int:
        require_model(self, model_id)
        return adapter_io.export_adapter(self._lora, model_id, directory, self._card.name)
