"""The engines that serve `sgd_step`'s verb: what a contributor adds to each engine that runs it
(lockstep/workers/local/trainer.py, and a test engine): the verb in its capabilities and a
method of its name. Every other engine is left as it is (admission refuses the op there)."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from lockstep.engine.capabilities import TrainerCapabilities
from lockstep.engine.pass_checks import require_model
from lockstep.workers.local.trainer import LocalTrainingEngine

from ..arithmetic_engine import DIM, ArithmeticTrainingEngine


class SgdArithmetic(ArithmeticTrainingEngine):
    """The FAKE arithmetic engine (tests/integration/arithmetic_engine.py), with the verb."""

    def capabilities(self) -> TrainerCapabilities:
        caps = super().capabilities()
        return dataclasses.replace(caps, verbs=caps.verbs | {"sgd_step"})

    def sgd_step(self, model_id: str, learning_rate: float) -> float:
        state = self.models[model_id]
        norm = float(np.linalg.norm(state.g))
        state.w, state.g = state.w - learning_rate * state.g, np.zeros(DIM)
        return norm


class SgdLocalTrainer(LocalTrainingEngine):
    """The local trainer, with the verb."""

    def capabilities(self) -> TrainerCapabilities:
        caps = super().capabilities()
        return dataclasses.replace(caps, verbs=caps.verbs | {"sgd_step"})

    def sgd_step(self, model_id: str, learning_rate: float) -> float:
        require_model(self, model_id)
        params = [p for p in self._lora.adapter_parameters(model_id) if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        with torch.no_grad():
            for p in params:
                p.sub_(learning_rate * p.grad)
                p.grad = None  # as after an optimizer step: the next passes start afresh
        return float(norm)
