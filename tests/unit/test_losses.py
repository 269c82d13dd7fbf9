"""The loss table, submission-time validation, and the torch loss formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lockstep.engine.losses import (
    LOSSES,
    UNSUPPORTED_LOSSES,
    resolve_loss_config,
    validate_pass_request,
)
from lockstep.engine.types import Datum, PassRequest
from lockstep.errors import UserInputError
from lockstep.training.losses import TORCH_LOSSES, elementwise_loss

VOCAB, CTX = 100, 64


def _datum(n: int = 6, **extra: np.ndarray) -> Datum:
    inputs: dict[str, np.ndarray] = {"target_tokens": np.arange(1, n + 1, dtype=np.int64)}
    inputs.update(extra)
    return Datum(tokens=np.arange(n, dtype=np.int64), loss_inputs=inputs)


def _rl_datum(n: int = 6) -> Datum:
    return _datum(n, logprobs=np.full(n, -1.0, np.float32), advantages=np.ones(n, np.float32))


def _gspo_datum(mask: list[float]) -> Datum:
    n = len(mask)
    return _datum(
        n,
        logprobs=np.full(n, -1.0, np.float32),
        advantages=np.ones(n, np.float32),
        sequence_ratio_mask=np.asarray(mask, np.float32),
    )


def _req(
    loss_fn: str, data: list[Datum], config: dict[str, float | str] | None = None
) -> PassRequest:
    return PassRequest("r", "m", loss_fn, config or {}, False, data)


def _field(req: PassRequest) -> str:
    with pytest.raises(UserInputError) as info:
        validate_pass_request(req, VOCAB, CTX)
    return info.value.field


def test_table_and_torch_losses_agree() -> None:
    assert set(LOSSES) == set(TORCH_LOSSES)
    assert set(LOSSES) >= {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"}
    assert not set(LOSSES) & set(UNSUPPORTED_LOSSES)


def test_valid_requests_pass_and_extra_keys_are_ignored() -> None:
    validate_pass_request(_req("cross_entropy", [_datum()]), VOCAB, CTX)
    validate_pass_request(
        _req("cross_entropy", [_datum(weights=np.ones(6, np.float32), mask=np.ones(3))]), VOCAB, CTX
    )
    two_d = _datum(target_tokens=np.ones((6, 3), np.int64), weights=np.ones((6, 3), np.float32))
    validate_pass_request(_req("cross_entropy", [two_d]), VOCAB, CTX)
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        validate_pass_request(_req(loss, [_rl_datum(), _rl_datum(3)], {"unknown": 1.0}), VOCAB, CTX)
    validate_pass_request(_req("gspo", [_gspo_datum([0, 0, 1, 1]), _gspo_datum([1])]), VOCAB, CTX)


def test_unsupported_losses_say_why() -> None:
    with pytest.raises(UserInputError) as info:
        validate_pass_request(_req("stable_reinforce", [_rl_datum()]), VOCAB, CTX)
    assert info.value.field == "loss_fn"
    assert "stable_reinforce is not supported" in str(info.value)
    assert "importance_sampling" in str(info.value)


def test_shape_mismatch_names_the_field() -> None:
    bad = _datum(5, weights=np.ones(4, np.float32))
    with pytest.raises(UserInputError) as info:
        validate_pass_request(_req("cross_entropy", [_datum(), bad]), VOCAB, CTX)
    assert str(info.value) == "data[1].loss_fn_inputs.weights: length 4 != model_input length 5"
    short_targets = Datum(np.arange(6), {"target_tokens": np.arange(5)})
    assert _field(_req("cross_entropy", [short_targets])) == "data[0].loss_fn_inputs.target_tokens"


@pytest.mark.parametrize(
    ("req", "field"),
    [
        (_req("nope", [_datum()]), "loss_fn"),
        (_req("cross_entropy", []), "data"),
        (_req("ppo", [_datum()]), "data[0].loss_fn_inputs.logprobs"),
        (_req("cross_entropy", [Datum(np.arange(6), {})]), "data[0].loss_fn_inputs.target_tokens"),
        (
            _req("cross_entropy", [Datum(np.array([1, 100]), {"target_tokens": np.array([1, 2])})]),
            "data[0].model_input",
        ),
        (
            _req("cross_entropy", [Datum(np.array([1, 2]), {"target_tokens": np.array([1, -1])})]),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            _req(
                "cross_entropy",
                [Datum(np.arange(CTX + 1) % VOCAB, {"target_tokens": np.zeros(CTX + 1, np.int64)})],
            ),
            "data[0].model_input",
        ),
        (
            _req("cross_entropy", [Datum(np.array([], np.int64), {"target_tokens": np.array([])})]),
            "data[0].model_input",
        ),
        (
            _req(
                "ppo",
                [
                    _datum(
                        target_tokens=np.ones((6, 2), np.int64),
                        logprobs=np.zeros((6, 2), np.float32),
                        advantages=np.zeros((6, 2), np.float32),
                    )
                ],
            ),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            _req(
                "cross_entropy",
                [_datum(target_tokens=np.ones((6, 2), np.int64), weights=np.ones(6, np.float32))],
            ),
            "data[0].loss_fn_inputs.weights",
        ),
        (
            _req(
                "importance_sampling",
                [
                    _datum(
                        logprobs=np.zeros(6, np.float32),
                        advantages=np.array([0, 1, np.nan, 0, 0, 0]),
                    )
                ],
            ),
            "data[0].loss_fn_inputs.advantages",
        ),
        (
            _req("cross_entropy", [_datum(target_tokens=np.ones(6, np.float32))]),
            "data[0].loss_fn_inputs.target_tokens",
        ),
        (
            _req("ppo", [_rl_datum()], {"clip_low_threshold": "x"}),
            "loss_fn_config.clip_low_threshold",
        ),
        (
            _req("ppo", [_rl_datum()], {"clip_low_threshold": 1.5}),
            "loss_fn_config.clip_low_threshold",
        ),
        (_req("dro", [_rl_datum()], {"beta": float("nan")}), "loss_fn_config.beta"),
        (_req("gspo", [_rl_datum()]), "data[0].loss_fn_inputs.sequence_ratio_mask"),
        (
            _req("gspo", [_gspo_datum([1, 1]), _gspo_datum([0, 0, 0])]),
            "data[1].loss_fn_inputs.sequence_ratio_mask",
        ),
        (
            _req("gspo", [_gspo_datum([1, 1, 1]), _datum(3, sequence_ratio_mask=np.ones(2))]),
            "data[1].loss_fn_inputs.logprobs",
        ),
    ],
)
def test_bad_requests(req: PassRequest, field: str) -> None:
    assert _field(req) == field


def test_config_defaults() -> None:
    assert resolve_loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("cispo", {"clip_high_threshold": 2}) == {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 2.0,
    }
    assert resolve_loss_config("dro", {})["beta"] == 0.05
    assert resolve_loss_config("cross_entropy", {"anything": 3.0}) == {}


def _grad(
    loss_fn: str, logp: torch.Tensor, inputs: dict[str, torch.Tensor], cfg: dict[str, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logp.clone().requires_grad_(True)
    loss = elementwise_loss(loss_fn, x, inputs, cfg)
    loss.sum().backward()
    assert x.grad is not None
    return loss.detach(), x.grad


def test_formulas_match_tinker_definitions() -> None:
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(50, generator=g) * 3
    q = logp + (torch.rand(50, generator=g) - 0.5)  # ratios around 0.6 .. 1.6: clipping kicks in
    adv = torch.randn(50, generator=g)
    w = torch.randn(50, generator=g)
    rl = {"logprobs": q, "advantages": adv}
    ratio = torch.exp(logp - q)
    clip = torch.clamp(ratio, 0.8, 1.2)

    loss, grad = _grad("cross_entropy", logp, {"weights": w}, {})
    torch.testing.assert_close(loss, -logp * w)
    torch.testing.assert_close(grad, -w)
    loss, _ = _grad("cross_entropy", logp, {}, {})
    torch.testing.assert_close(loss, -logp)

    loss, grad = _grad("importance_sampling", logp, rl, {})
    torch.testing.assert_close(loss, -ratio * adv)
    torch.testing.assert_close(grad, -ratio * adv)

    cfg = resolve_loss_config("ppo", {})
    loss, _ = _grad("ppo", logp, rl, cfg)
    torch.testing.assert_close(loss, -torch.minimum(ratio * adv, clip * adv))

    loss, grad = _grad("cispo", logp, rl, cfg)
    torch.testing.assert_close(loss, -clip * logp * adv)
    torch.testing.assert_close(grad, -clip * adv)  # the clipped ratio is a constant

    loss, grad = _grad("dro", logp, rl, {"beta": 0.3})
    torch.testing.assert_close(loss, -(logp * adv - 0.15 * (logp - q) ** 2))
    torch.testing.assert_close(grad, -(adv - 0.3 * (logp - q)))

    # Per-token thresholds override the config.
    lo, hi = torch.full((50,), 0.5), torch.full((50,), 3.0)
    loss, _ = _grad("ppo", logp, {**rl, "clip_low_threshold": lo, "clip_high_threshold": hi}, cfg)
    wide = torch.clamp(ratio, 0.5, 3.0)
    torch.testing.assert_close(loss, -torch.minimum(ratio * adv, wide * adv))


def test_two_d_cross_entropy_is_elementwise() -> None:
    logp = -torch.rand(4, 3)
    w = torch.rand(4, 3)
    loss = elementwise_loss("cross_entropy", logp, {"weights": w}, {})
    assert loss.shape == (4, 3)
    torch.testing.assert_close(loss, -logp * w)


def test_gspo_is_tinkers_gspo_token() -> None:
    """The sequence ratio over the masked tokens, each token's own gradient, PPO-style clipping."""
    g = torch.Generator().manual_seed(1)
    n = 12
    logp = -torch.rand(n, generator=g) * 3
    q = logp + (torch.rand(n, generator=g) - 0.5) * 0.6
    adv = torch.randn(n, generator=g)
    mask = torch.zeros(n)
    mask[4:] = 1.0  # the prompt (first 4 tokens) does not count towards the ratio
    q_prompt_garbage = q.clone()
    q_prompt_garbage[:4] = 0.0  # the cookbook sends logprob 0 for prompt tokens
    inputs = {"logprobs": q_prompt_garbage, "advantages": adv, "sequence_ratio_mask": mask}
    cfg = resolve_loss_config("gspo", {})
    assert cfg == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

    loss, grad = _grad("gspo", logp, inputs, cfg)
    s = torch.exp((logp[4:] - q[4:]).mean())
    clipped = torch.clamp(s, 0.8, 1.2)
    torch.testing.assert_close(loss, -torch.minimum(s * adv, clipped * adv))
    # d(-s_t A_t)/dlogp_t = -s A_t where the unclipped term is the min, else 0.
    active = (s * adv) <= (clipped * adv)
    torch.testing.assert_close(grad, torch.where(active, -s * adv, torch.zeros(n)))

    # On-policy (q == logp on the masked tokens): s == 1, the loss is -A and the gradient -A.
    on_policy = {**inputs, "logprobs": torch.where(mask > 0, logp, torch.zeros(n))}
    loss, grad = _grad("gspo", logp, on_policy, cfg)
    torch.testing.assert_close(loss, -adv)
    torch.testing.assert_close(grad, -adv)

    # The ratio is one number per datum: far off-policy, every token is clipped the same way.
    far = {**inputs, "logprobs": torch.where(mask > 0, logp - 1.0, torch.zeros(n))}
    loss, _ = _grad("gspo", logp, far, cfg)  # s = e > 1.2
    torch.testing.assert_close(loss, -torch.minimum(math.e * adv, 1.2 * adv))
