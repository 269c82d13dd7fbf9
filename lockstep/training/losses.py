"""Torch implementations of the built-in losses, as Tinker defines them (token-level SUMS).

Notation, per token t of a datum: `logp_t` = log-prob of target_tokens[t] under the model being
trained (differentiable), `q_t` = `loss_fn_inputs["logprobs"][t]` (the sampler's log-prob),
`A_t` = advantages[t], `ratio_t = exp(logp_t - q_t)`. Every function returns the ELEMENTWISE
loss (shape of target_tokens); the datum's loss is its sum, and `loss:sum` sums over datums.

- cross_entropy:        l_t = -logp_t * w_t          (w = weights, default 1; any real value;
                        [T, K] targets with [T, K] weights give per-(t, k) terms: soft targets)
- importance_sampling:  l_t = -ratio_t * A_t
- ppo:                  l_t = -min(ratio_t * A_t, clip(ratio_t, lo, hi) * A_t)
- cispo:                l_t = -stopgrad(clip(ratio_t, lo, hi)) * logp_t * A_t
- dro:                  l_t = -(logp_t * A_t - 0.5 * beta * (logp_t - q_t)^2)
- gspo (GSPO-token):    s = exp(mean_{t in M}(logp_t - q_t)), M = {t: sequence_ratio_mask_t != 0}
                        (the datum's sequence ratio, held constant);
                        s_t = s * exp(logp_t - sg(logp_t))  (s's value, logp_t's gradient);
                        l_t = -min(s_t * A_t, clip(s_t, lo, hi) * A_t)

lo / hi are the ratio bounds `clip_low_threshold` / `clip_high_threshold` (default 0.8 / 1.2,
i.e. epsilon 0.2 as in Tinker); a per-token tensor of the same name in loss_fn_inputs overrides
the config (ppo, cispo, gspo). `beta` defaults to 0.05 (the value Tinker's docs use in their DRO
example; Tinker does not document a default).

stable_reinforce is refused with a 400 (see `lockstep.engine.losses.UNSUPPORTED_LOSSES`): Tinker
does not document the sampler-side stability information its objective uses.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lockstep.engine.losses import LOSSES, loss_def
from lockstep.engine.types import Datum
from lockstep.training.logprobs import (
    Head,
    LinearHead,
    LogprobFn,
    gather_logprobs,
    target_logprobs,
)

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict[str, float]], torch.Tensor]


def _cross_entropy(logp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    weights = inputs.get("weights")
    return -logp if weights is None else -logp * weights


def _ratio(logp: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    return torch.exp(logp - inputs["logprobs"])


def _clip_bounds(
    inputs: Inputs, config: dict[str, float]
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    low = inputs.get("clip_low_threshold", config["clip_low_threshold"])
    high = inputs.get("clip_high_threshold", config["clip_high_threshold"])
    return low, high


def _clamp(x: torch.Tensor, low: torch.Tensor | float, high: torch.Tensor | float) -> torch.Tensor:
    if isinstance(low, torch.Tensor) or isinstance(high, torch.Tensor):
        return torch.minimum(torch.maximum(x, torch.as_tensor(low)), torch.as_tensor(high))
    return torch.clamp(x, low, high)


def _importance_sampling(
    logp: torch.Tensor, inputs: Inputs, config: dict[str, float]
) -> torch.Tensor:
    return -(_ratio(logp, inputs) * inputs["advantages"])


def _ppo(logp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    ratio = _ratio(logp, inputs)
    adv = inputs["advantages"]
    low, high = _clip_bounds(inputs, config)
    return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)


def _cispo(logp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    low, high = _clip_bounds(inputs, config)
    weight = _clamp(_ratio(logp, inputs), low, high).detach()
    return -(weight * logp * inputs["advantages"])


def _dro(logp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    quadratic = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * quadratic)


def _gspo(logp: torch.Tensor, inputs: Inputs, config: dict[str, float]) -> torch.Tensor:
    """Tinker's GSPO-token: every token carries its datum's sequence ratio (the geometric mean of
    the token ratios over the tokens `sequence_ratio_mask` marks) with its own log-prob's
    gradient, clipped like PPO. A datum is one sequence; validation ensures M is non-empty."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    log_ratio = (logp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    adv = inputs["advantages"]
    low, high = _clip_bounds(inputs, config)
    return -torch.minimum(ratio * adv, _clamp(ratio, low, high) * adv)


TORCH_LOSSES: dict[str, LossFn] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
}
assert set(TORCH_LOSSES) == set(LOSSES), "the torch losses and the loss table must agree"


def elementwise_loss(
    loss_fn: str, logp: torch.Tensor, inputs: Inputs, config: dict[str, float]
) -> torch.Tensor:
    """Per-token loss terms for one datum (shape of `logp`). `inputs` holds only the loss's known
    keys as float32 tensors on logp's device; `config` is `resolve_loss_config(...)`."""
    return TORCH_LOSSES[loss_fn](logp, inputs, config)


def datum_targets(datum: Datum, device: torch.device) -> torch.Tensor:
    """The datum's target_tokens as int64 [T, K] (K = 1 for 1-D targets) on `device`."""
    targets = torch.from_numpy(np.asarray(datum.loss_inputs["target_tokens"], np.int64))
    return targets.reshape(targets.shape[0], -1).to(device)


def loss_from_logprobs(
    logp: torch.Tensor, datum: Datum, loss_fn: str, config: dict[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, elementwise loss) of one datum from its target logprobs [T, K], both shaped like
    target_tokens. Every training engine computes its losses through this."""
    ldef = loss_def(loss_fn)
    logp = logp.reshape(np.asarray(datum.loss_inputs["target_tokens"]).shape)
    inputs = {
        key: torch.as_tensor(np.asarray(datum.loss_inputs[key], np.float32), device=logp.device)
        for key in ldef.required_inputs[1:] + ldef.optional_inputs
        if key in datum.loss_inputs
    }
    return logp, elementwise_loss(loss_fn, logp, inputs, config)


def datum_logprobs(
    hidden: torch.Tensor,
    datum: Datum,
    head: Head | LinearHead,
    chunk: int,
    logprob_fn: LogprobFn = gather_logprobs,
) -> torch.Tensor:
    """Target logprobs of one datum from its final hidden states [T, H]; the LM head runs in
    chunks of `chunk` positions (`lockstep.training.logprobs`)."""
    return target_logprobs(hidden, datum_targets(datum, hidden.device), head, chunk, logprob_fn)
