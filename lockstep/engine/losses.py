"""The built-in loss functions: what each needs, and the submission-time check of a request.

Pure Python + numpy (no torch) so the scheduler can reject a bad request with a 400 before it is
queued. The torch implementations (`lockstep.training.losses`) read the same table, so the
two cannot drift apart.

Conventions (Tinker's): position i of a datum's `tokens` predicts `target_tokens[i]`; every 1-D
loss input has the length of `tokens`; losses are token-level SUMS (no normalisation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from lockstep.engine.types import Datum, LossConfig, PassRequest
from lockstep.errors import UserInputError

_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
_RL_INPUTS = ("target_tokens", "logprobs", "advantages")
_PER_TOKEN_CLIPS = ("clip_low_threshold", "clip_high_threshold")

# Losses Tinker defines that this server refuses, with the reason the 400 carries.
UNSUPPORTED_LOSSES: dict[str, str] = {
    "stable_reinforce": (
        "stable_reinforce is not supported by this server: its objective uses stability "
        "information the sampler records (record_stability_info=True) that Tinker does not "
        "document, so it cannot be reproduced faithfully; use importance_sampling, ppo, cispo "
        "or gspo"
    ),
}
CUSTOM = "custom"  # a stored custom loss (create_custom_loss), named by loss_fn_config.loss_id


@dataclass(frozen=True)
class LossDef:
    """One loss: its loss_fn_inputs and loss_fn_config keys (with defaults)."""

    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...] = ()
    config_defaults: dict[str, float] = field(default_factory=dict)
    allows_2d_targets: bool = False  # [T, K] targets (top-K soft cross-entropy)
    nonempty_mask: str | None = None  # an input that must mark (!= 0) at least one token


LOSSES: dict[str, LossDef] = {
    d.name: d
    for d in (
        LossDef("cross_entropy", ("target_tokens",), ("weights",), allows_2d_targets=True),
        LossDef("importance_sampling", _RL_INPUTS),
        LossDef("ppo", _RL_INPUTS, _PER_TOKEN_CLIPS, dict(_CLIP)),
        LossDef("cispo", _RL_INPUTS, _PER_TOKEN_CLIPS, dict(_CLIP)),
        LossDef("dro", _RL_INPUTS, (), {"beta": 0.05}),
        LossDef(
            "gspo",
            (*_RL_INPUTS, "sequence_ratio_mask"),
            _PER_TOKEN_CLIPS,
            dict(_CLIP),
            nonempty_mask="sequence_ratio_mask",
        ),
    )
}


# A custom loss reads target_tokens like cross_entropy; its other inputs are its own, checked
# against the loss at admission (`lockstep.custom_loss.graph.check_datum`).
_CUSTOM_DEF = LossDef(CUSTOM, ("target_tokens",), allows_2d_targets=True)


def loss_def(loss_fn: str) -> LossDef:
    if loss_fn == CUSTOM:
        return _CUSTOM_DEF
    try:
        return LOSSES[loss_fn]
    except KeyError:
        if loss_fn in UNSUPPORTED_LOSSES:
            raise UserInputError("loss_fn", UNSUPPORTED_LOSSES[loss_fn]) from None
        raise UserInputError(
            "loss_fn", f"unsupported loss {loss_fn!r}; supported: {', '.join(sorted(LOSSES))}"
        ) from None


def resolve_loss_config(loss_fn: str, config: LossConfig) -> dict[str, float]:
    """The loss's config keys with defaults filled in; unknown keys are ignored.

    Raises:
        UserInputError: a known key is not a finite number, or clip_low > clip_high.
    """
    out: dict[str, float] = {}
    for key, default in loss_def(loss_fn).config_defaults.items():
        value = config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserInputError(f"loss_fn_config.{key}", f"must be a number, got {value!r}")
        if not math.isfinite(value):
            raise UserInputError(f"loss_fn_config.{key}", f"must be finite, got {value!r}")
        out[key] = float(value)
    if out.get("clip_low_threshold", 0.0) > out.get("clip_high_threshold", math.inf):
        raise UserInputError(
            "loss_fn_config.clip_low_threshold",
            f"{out['clip_low_threshold']} > clip_high_threshold {out['clip_high_threshold']}",
        )
    return out


def validate_datum(
    datum: Datum, index: int, ldef: LossDef, vocab_size: int, max_context: int
) -> None:
    """Check one datum of a request; field names look like `data[3].loss_fn_inputs.weights`."""
    where = f"data[{index}]"
    tokens = np.asarray(datum.tokens)
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise UserInputError(
            f"{where}.model_input", f"must be a non-empty 1-D token list, got shape {tokens.shape}"
        )
    n = int(tokens.shape[0])
    if n > max_context:
        raise UserInputError(
            f"{where}.model_input", f"length {n} exceeds the model's context length {max_context}"
        )
    _check_ids(tokens, f"{where}.model_input", vocab_size)
    inputs = datum.loss_inputs
    for key in ldef.required_inputs:
        if key not in inputs:
            raise UserInputError(
                f"{where}.loss_fn_inputs.{key}", f"required by loss_fn {ldef.name!r}"
            )
    targets = np.asarray(inputs["target_tokens"])
    _check_targets(targets, f"{where}.loss_fn_inputs.target_tokens", n, ldef, vocab_size)
    for key in ldef.required_inputs[1:] + ldef.optional_inputs:
        if key in inputs:
            _check_aligned(np.asarray(inputs[key]), f"{where}.loss_fn_inputs.{key}", n, targets)
    if ldef.nonempty_mask is not None and not np.any(np.asarray(inputs[ldef.nonempty_mask])):
        raise UserInputError(
            f"{where}.loss_fn_inputs.{ldef.nonempty_mask}",
            f"must mark at least one token (loss_fn {ldef.name!r} averages over the marked tokens)",
        )


def _check_targets(
    targets: np.ndarray, tfield: str, n: int, ldef: LossDef, vocab_size: int
) -> None:
    if targets.ndim not in ((1, 2) if ldef.allows_2d_targets else (1,)):
        raise UserInputError(
            tfield,
            f"must be {'1-D or 2-D' if ldef.allows_2d_targets else '1-D'}, "
            f"got shape {targets.shape}",
        )
    if targets.shape[0] != n:
        raise UserInputError(tfield, f"length {targets.shape[0]} != model_input length {n}")
    if targets.ndim == 2 and targets.shape[1] == 0:
        raise UserInputError(tfield, "second dimension (K) must be >= 1")
    _check_ids(targets, tfield, vocab_size)


def _check_aligned(value: np.ndarray, vfield: str, n: int, targets: np.ndarray) -> None:
    """A per-token loss input: the shape of target_tokens, real and finite."""
    if value.ndim >= 1 and value.shape[0] != n:
        raise UserInputError(vfield, f"length {value.shape[0]} != model_input length {n}")
    if value.shape != targets.shape:
        raise UserInputError(vfield, f"shape {value.shape} != target_tokens shape {targets.shape}")
    if not np.issubdtype(value.dtype, np.number) or np.issubdtype(value.dtype, np.complexfloating):
        raise UserInputError(vfield, f"must be real numbers, got dtype {value.dtype}")
    if not np.all(np.isfinite(value)):
        raise UserInputError(vfield, "must be finite (found NaN or inf)")


def _check_ids(ids: np.ndarray, where: str, vocab_size: int) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise UserInputError(where, f"token ids must be integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
        raise UserInputError(where, f"token id {bad} outside [0, {vocab_size})")


def validate_pass_request(req: PassRequest, vocab_size: int, max_context: int) -> None:
    """Reject a malformed forward / forward_backward request before it is queued.

    Raises:
        UserInputError: unknown loss, bad config, no data, or a datum with a missing, mis-shaped,
            non-finite or out-of-vocabulary input. Unknown loss_fn_inputs keys are ignored.
    """
    ldef = loss_def(req.loss_fn)
    resolve_loss_config(req.loss_fn, req.loss_config)
    if req.loss_fn == CUSTOM and req.custom_loss is None:
        raise UserInputError("loss_fn_config.loss_id", "names no custom loss of this session")
    if not req.data:
        raise UserInputError("data", "no datums")
    for i, datum in enumerate(req.data):
        validate_datum(datum, i, ldef, vocab_size, max_context)


def custom_loss_id(config: LossConfig) -> str:
    """The loss id a loss_fn "custom" request names."""
    loss_id = config.get("loss_id")
    if not isinstance(loss_id, str) or not loss_id:
        raise UserInputError(
            "loss_fn_config.loss_id", "loss_fn 'custom' needs the loss id create_custom_loss gave"
        )
    return loss_id
