"""How probes call the SDK and the shared context they draw clients and paths from."""

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUTPUT = REPO / "docs" / "compatibility.md"
API_KEY = "tml-compat-matrix"
OTHER_KEY = "tml-compat-matrix-other"


class ClientSide(Exception):  # noqa: N818 - an outcome, not an error
    """The method never reaches the server; the message says what it does."""


@dataclass
class Outcome:
    status: str  # "supported" | "unsupported" | "client-side"
    note: str = ""


# ------------------------------------------------------------------------------ calling


def _resolve(value: Any) -> Any:
    """A future's result (APIFuture, the SDK's backcompat futures), else the value."""
    if hasattr(value, "result") and callable(value.result) and not isinstance(value, type):
        return value.result()
    return value


class Caller:
    """Calls `obj.name(...)` (sync) or `obj.name_async(...)` (awaited on a private loop)."""

    def __init__(self, cls_name: str, use_async: bool, loop: asyncio.AbstractEventLoop) -> None:
        self.cls_name = cls_name
        self.use_async = use_async
        self.loop = loop

    def __call__(self, obj: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        if not self.use_async:
            return _resolve(getattr(obj, name)(*args, **kwargs))

        async def run() -> Any:
            value = getattr(obj, f"{name}_async")(*args, **kwargs)
            while inspect.isawaitable(value):
                value = await value
            if hasattr(value, "result_async"):
                value = await value.result_async()
            return value

        return self.loop.run_until_complete(run())


# ------------------------------------------------------------------------------ context


@dataclass
class Ctx:
    base_url: str
    base_model: str
    counter: int = 0
    _cache: dict[str, Any] = field(default_factory=dict)

    def name(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter}"

    @cached_property
    def service(self) -> Any:
        import tinker

        return tinker.ServiceClient(base_url=self.base_url, api_key=API_KEY)

    @cached_property
    def other(self) -> Any:
        import tinker

        return tinker.ServiceClient(base_url=self.base_url, api_key=OTHER_KEY)

    @cached_property
    def rest(self) -> Any:
        return self.service.create_rest_client()

    def trainer(self) -> Any:
        """A fresh LoRA training client (rank 4) that has taken one step."""
        from tinker import types

        tc = self.service.create_lora_training_client(
            base_model=self.base_model, rank=4, seed=0
        ).result()
        tc.forward_backward([self.datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        return tc

    @cached_property
    def shared_trainer(self) -> Any:
        return self.trainer()

    @cached_property
    def state_path(self) -> str:
        return str(self.shared_trainer.save_state("compat-state").result().path)

    @cached_property
    def sampler_path(self) -> str:
        return str(self.shared_trainer.save_weights_for_sampler("compat-sampler").result().path)

    @cached_property
    def tokenizer(self) -> Any:
        return self.shared_trainer.get_tokenizer()

    @cached_property
    def sampler(self) -> Any:
        return self.service.create_sampling_client(base_model=self.base_model).result()

    @property
    def run_id(self) -> str:
        return str(self.shared_trainer.model_id)

    def datum(self, n: int = 8, **inputs: Any) -> Any:
        from tinker import types

        tokens = list(range(1, n + 1))
        loss_inputs: dict[str, Any] = {"target_tokens": [t + 1 for t in tokens]}
        loss_inputs.update(inputs)
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_inputs
        )

    def rl_datum(self, n: int = 8, **extra: Any) -> Any:
        trainer = self.shared_trainer
        plain = self.datum(n)
        logprobs = (
            trainer.forward([plain], "cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .to_numpy()
        )
        return self.datum(
            n,
            logprobs=logprobs.astype(np.float32).tolist(),
            advantages=[0.0] * (n // 2) + [1.0] * (n - n // 2),
            **extra,
        )

    def prompt(self, n: int = 6) -> Any:
        from tinker import types

        return types.ModelInput.from_ints(list(range(1, n + 1)))


# ------------------------------------------------------------------------------ probes

Probe = Callable[[Ctx, Caller], "str | None"]
PROBES: dict[str, Probe] = {}


def probe(*names: str) -> Callable[[Probe], Probe]:
    def register(fn: Probe) -> Probe:
        for name in names:
            PROBES[name] = fn
        return fn

    return register


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)
