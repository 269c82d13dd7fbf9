"""AdamW for many tenants in ONE batched update.

Same arithmetic as `torch.optim.AdamW` (decoupled weight decay, bias correction, eps added after
the bias-corrected sqrt) and `torch.nn.utils.clip_grad_norm_` (global L2 norm per tenant,
coefficient max_norm / (norm + 1e-6) clamped to 1). Every tenant's tensors go through the same
`torch._foreach_*` calls; where hyperparameters or step counts differ, each tensor carries its
own scalar (ScalarList overloads), so one call updates every adapter of the clock cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lockstep.engine.types import AdamConfig


@dataclass
class AdamState:
    """One tenant's moments (aligned with its parameter list) and step count."""

    step: int = 0
    exp_avg: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sq: list[torch.Tensor] = field(default_factory=list)


@dataclass
class AdamGroup:
    """What one optim_step request updates."""

    params: list[torch.nn.Parameter]
    state: AdamState
    config: AdamConfig


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor `clip_grad_norm_` scales gradients by: max_norm / (norm + 1e-6), at most 1.
    max_norm <= 0: no clipping (1.0). Every training engine clips through this."""
    if max_norm <= 0:
        return 1.0
    total = torch.tensor(total_norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (total + 1e-6), max=1.0))


def global_grad_norms(groups: list[AdamGroup]) -> list[float]:
    """Each group's global L2 grad norm over its own tensors (0.0 without gradients)."""
    out = [0.0] * len(groups)
    live = [i for i, g in enumerate(groups) if any(p.grad is not None for p in g.params)]
    flat = [_grad(p) for i in live for p in groups[i].params]
    per_tensor = list(torch._foreach_norm(flat)) if flat else []
    offset = 0
    for i in live:
        n = len(groups[i].params)
        out[i] = float(torch.linalg.vector_norm(torch.stack(per_tensor[offset : offset + n])))
        offset += n
    return out


@torch.no_grad()
def batched_adamw_step(groups: list[AdamGroup], norms: list[float] | None = None) -> list[float]:
    """Clip, step every group, then drop its grads. Returns each group's pre-clip grad norm.

    `norms`: the groups' global grad norms when an engine holds only shards of each adapter
    (Megatron sums them over TP x PP); by default each group's own tensors make its norm.
    A group with no gradient at all (no forward_backward since its last step) is left untouched,
    as torch.optim skips parameters whose `.grad` is None.
    """
    live = [i for i, g in enumerate(groups) if any(p.grad is not None for p in g.params)]
    norms_out = global_grad_norms(groups) if norms is None else list(norms)
    if not live:
        return norms_out
    grads = {i: [_grad(p) for p in groups[i].params] for i in live}
    clip_tensors: list[torch.Tensor] = []
    clip_scalars: list[float] = []
    for i in live:
        coef = clip_coefficient(norms_out[i], groups[i].config.grad_clip_norm)
        if groups[i].config.grad_clip_norm > 0:
            clip_tensors += grads[i]
            clip_scalars += [coef] * len(grads[i])
    if clip_tensors:
        torch._foreach_mul_(clip_tensors, clip_scalars)

    params: list[torch.Tensor] = []
    flat: list[torch.Tensor] = []
    exp_avg: list[torch.Tensor] = []
    exp_avg_sq: list[torch.Tensor] = []
    scalars: dict[str, list[float]] = {k: [] for k in ("b1", "b2", "1-b2", "bc2", "eps", "lr")}
    decay_params: list[torch.Tensor] = []
    decay_scalars: list[float] = []
    for i in live:
        g = groups[i]
        cfg, state = g.config, g.state
        if not state.exp_avg:
            state.exp_avg = [torch.zeros_like(p) for p in g.params]
            state.exp_avg_sq = [torch.zeros_like(p) for p in g.params]
        state.step += 1
        n = len(g.params)
        params += g.params
        flat += grads[i]
        exp_avg += state.exp_avg
        exp_avg_sq += state.exp_avg_sq
        step = float(state.step)
        scalars["b1"] += [1 - cfg.beta1] * n
        scalars["b2"] += [cfg.beta2] * n
        scalars["1-b2"] += [1 - cfg.beta2] * n
        scalars["bc2"] += [(1 - cfg.beta2**step) ** 0.5] * n
        scalars["eps"] += [cfg.eps] * n
        scalars["lr"] += [-(cfg.learning_rate / (1 - cfg.beta1**step))] * n
        if cfg.weight_decay != 0:
            decay_params += g.params
            decay_scalars += [1 - cfg.learning_rate * cfg.weight_decay] * n
    if decay_params:
        torch._foreach_mul_(decay_params, decay_scalars)
    torch._foreach_lerp_(exp_avg, flat, scalars["b1"])
    torch._foreach_mul_(exp_avg_sq, scalars["b2"])
    torch._foreach_addcmul_(exp_avg_sq, flat, flat, scalars["1-b2"])
    denom = torch._foreach_sqrt(exp_avg_sq)
    torch._foreach_div_(denom, scalars["bc2"])
    torch._foreach_add_(denom, scalars["eps"])
    torch._foreach_addcdiv_(params, exp_avg, denom, scalars["lr"])
    for i in live:
        for p in groups[i].params:
            p.grad = None
    return norms_out


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
