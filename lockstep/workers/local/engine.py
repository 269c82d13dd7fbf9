"""The local training engine: one process, torch, CPU or one GPU, every tenant in one model.

A clock cycle is `run_passes` (one fused forward over every tenant's datums, one backward) then
`optim_step` (one batched AdamW over every adapter that asked). Packing never changes a tenant's
numbers: rows are right-padded, each row uses its own adapter (per-adapter groups in
`MultiLoRALinear`, padding excluded), and every base matmul sees >= 8 rows so CPU GEMM takes the
same kernel whether a tenant runs alone or packed (small-M kernels round differently).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lockstep.engine.interface import TrainingEngine, UserInputError
from lockstep.engine.losses import resolve_loss_config, validate_pass_request
from lockstep.engine.types import (
    Datum,
    LoraSpec,
    ModelCard,
    OptimRequest,
    PassRequest,
    PassResult,
)
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel, validate_spec
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.workers.local import checkpoint
from lockstep.workers.local.losses import datum_loss
from lockstep.workers.local.optim import AdamGroup, AdamState, batched_adamw_step, validate_adam

PAD_MULTIPLE = 8  # padded length is a multiple of 8, so every GEMM has M >= 8 rows


@dataclass
class _Row:
    request: int  # index into the run_passes request list
    datum: Datum
    length: int


class LocalTrainingEngine(TrainingEngine):
    def __init__(
        self, model_dir: Path, served_name: str, device: torch.device | str | None = None
    ) -> None:
        model, self._card = load_base_model(model_dir, served_name, device)
        self._model = model
        self._lora = LoraModel(model)
        self._device: torch.device = next(model.parameters()).device
        self._adam: dict[str, AdamState] = {}

    # -- models ---------------------------------------------------------------------------

    def card(self) -> ModelCard:
        return self._card

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        """Create (or re-create from scratch) an adapter with fresh Adam state."""
        try:
            validate_spec(spec)
        except ValueError as exc:
            raise UserInputError("lora_config", str(exc)) from exc
        self.delete_model(model_id)
        self._lora.add_adapter(model_id, spec)
        self._adam[model_id] = AdamState()

    def delete_model(self, model_id: str) -> None:
        self._lora.remove_adapter(model_id)
        self._adam.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        return self._lora.has_adapter(model_id)

    def _require(self, model_id: str) -> None:
        if not self._lora.has_adapter(model_id):
            raise UserInputError("model_id", f"unknown model {model_id!r}")

    # -- forward / backward ---------------------------------------------------------------

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        card = self._card
        configs = []
        for req in requests:
            self._require(req.model_id)
            validate_pass_request(req, card.vocab_size, card.max_context_length)
            configs.append(resolve_loss_config(req.loss_fn, req.loss_config))
        results: list[PassResult | None] = [None] * len(requests)
        train = [i for i, r in enumerate(requests) if not r.forward_only]
        if train:
            self._fused_pass(requests, train, configs, results, backward=True)
        # Forward-only requests run in their own no-grad forward: they never touch any grad.
        evals = [i for i, r in enumerate(requests) if r.forward_only]
        if evals:
            with torch.no_grad():
                self._fused_pass(requests, evals, configs, results, backward=False)
        return [r for r in results if r is not None]

    def _fused_pass(
        self,
        requests: list[PassRequest],
        indices: list[int],
        configs: list[dict[str, float]],
        results: list[PassResult | None],
        backward: bool,
    ) -> None:
        rows = [
            _Row(i, d, int(np.asarray(d.tokens).shape[0]))
            for i in indices
            for d in requests[i].data
        ]
        longest = max(r.length for r in rows)
        seq = -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE
        input_ids = torch.zeros(len(rows), seq, dtype=torch.long)
        valid = torch.zeros(len(rows), seq, dtype=torch.bool)
        for b, row in enumerate(rows):
            input_ids[b, : row.length] = torch.from_numpy(np.asarray(row.datum.tokens, np.int64))
            valid[b, : row.length] = True
        input_ids, valid = input_ids.to(self._device), valid.to(self._device)
        positions = torch.arange(seq, device=self._device).expand(len(rows), seq)
        with self._lora.row_adapters([requests[r.request].model_id for r in rows], valid=valid):
            logits = self._model(
                input_ids=input_ids,
                attention_mask=valid.long(),
                position_ids=positions,
                use_cache=False,
            ).logits

        per_request: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {i: [] for i in indices}
        # One unbind instead of a slice per row: autograd then sums the rows' gradients into
        # the logits once, not once per row (the same numbers, a third less backward time).
        row_logits = logits.unbind(0)
        for row, row_out in zip(rows, row_logits, strict=True):
            req = requests[row.request]
            logp, loss = self._datum_loss(
                row_out[: row.length], row.datum, req.loss_fn, configs[row.request]
            )
            per_request[row.request].append((logp, loss))
        losses = {}
        for i, outs in per_request.items():
            losses[i] = torch.stack([loss.sum() for _, loss in outs]).sum()
            results[i] = PassResult(
                request_id=requests[i].request_id,
                outputs=[
                    {"logprobs": _to_numpy(lp), "elementwise_loss": _to_numpy(loss)}
                    for lp, loss in outs
                ],
                metrics={"loss:sum": float(losses[i].detach())},
            )
        if backward:
            # One backward over the sum: d(sum)/d(loss_i) = 1, so each adapter gets exactly the
            # gradient of its own requests' losses; .grad accumulates until optim_step.
            torch.stack(list(losses.values())).sum().backward()

    def _datum_loss(
        self, logits: torch.Tensor, datum: Datum, loss_fn: str, config: dict[str, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs of the targets, elementwise loss), both shaped like target_tokens."""
        return datum_loss(logits, datum, loss_fn, config)

    # -- optimizer ------------------------------------------------------------------------

    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        groups = []
        for req in requests:
            self._require(req.model_id)
            validate_adam(req.adam)
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
        self._require(model_id)
        return checkpoint.write_state(
            Path(directory),
            self._lora.adapter_state(model_id),
            self._lora.adapter_param_names(model_id),
            self._lora.spec(model_id),
            self._card.name,
            self._adam[model_id] if include_optimizer else None,
        )

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        state, spec = checkpoint.read_adapter(Path(directory), self._card.name)
        try:
            validate_spec(spec)
            # Build into a scratch id first so a bad checkpoint leaves `model_id` untouched.
            scratch = f"{model_id}\x00loading"
            self._lora.load_adapter_state(scratch, state, spec)
        except ValueError as exc:
            raise UserInputError("path", f"checkpoint does not fit this base model: {exc}") from exc
        try:
            adam = AdamState()
            if include_optimizer:
                adam = checkpoint.read_adam(
                    Path(directory),
                    self._lora.adapter_param_names(scratch),
                    list(self._lora.adapter_parameters(scratch)),
                )
        finally:
            self._lora.remove_adapter(scratch)
        self._lora.load_adapter_state(model_id, state, spec)
        self._adam[model_id] = adam
        return spec

    def export_adapter(self, model_id: str, directory: Path) -> int:
        self._require(model_id)
        return save_peft_adapter(
            Path(directory),
            self._lora.adapter_state(model_id),
            self._lora.spec(model_id),
            self._card.name,
        )


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy().copy()
