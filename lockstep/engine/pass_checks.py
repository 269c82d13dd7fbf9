"""What every training engine checks of a call before it runs anything of it.

The requests themselves were judged at admission (`lockstep.engine.losses`, the scheduler's
ops); what admission cannot know is the engine's own state: whether the model is resident, and
whether a later part of a request run in parts finds its first part's undo point
(`TrainingEngine.run_passes`, "Parts"). Each engine keeps that state its own way and passes it in.
"""

from __future__ import annotations

from collections.abc import Container

from lockstep.engine.interface import TrainingEngine
from lockstep.engine.losses import resolve_loss_config
from lockstep.engine.types import PassPart, PassRequest
from lockstep.errors import UserInputError


def require_model(engine: TrainingEngine, model_id: str) -> None:
    """Raises UserInputError ("model_id") unless `engine` holds the model."""
    if not engine.has_model(model_id):
        raise UserInputError("model_id", f"unknown model {model_id!r}")


def check_passes(
    engine: TrainingEngine, requests: list[PassRequest], kept: Container[str]
) -> list[dict[str, float]]:
    """The start of every `run_passes`: each request's model is resident and its loss config
    resolved (defaults filled in); a training MIDDLE or LAST part needs its model in `kept`, the
    models whose undo point (kept at their FIRST part) the engine still holds.

    Returns:
        Each request's resolved loss config, in order.
    Raises:
        UserInputError: a model the engine does not hold ("model_id").
        RuntimeError: a later part whose first part the engine did not keep: the scheduler runs
            the request again from its first part.
    """
    configs = []
    for req in requests:
        require_model(engine, req.model_id)
        configs.append(resolve_loss_config(req.loss_fn, req.loss_config))
    for req in requests:
        later = req.part in (PassPart.MIDDLE, PassPart.LAST)
        if later and not req.forward_only and req.model_id not in kept:
            raise RuntimeError(
                f"a {req.part} part of request {req.request_id} of {req.model_id}, whose first "
                "part this engine did not keep: run the request again from its first part"
            )
    return configs
