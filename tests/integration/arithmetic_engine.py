"""A deterministic FAKE training and sampling engine, for model-based tests of the request path.

Named as a fake on purpose: it exists for speed (hundreds of ops per second) and for exact
expectations. Its "adapter" is 4 float64 weights; a pass adds a feature vector of its data to the
accumulated gradient and reports loss = w . f; a step does w -= lr * g. Everything else (state
files, restarts losing every model) behaves like a real engine behind the same contract.
"""

from __future__ import annotations

import json
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lockstep.engine.capabilities import SamplerCapabilities, TrainerCapabilities
from lockstep.engine.interface import EngineDied, SamplingEngine, TrainingEngine
from lockstep.engine.types import (
    NO_MEMORY_LIMIT,
    Datum,
    LoraSpec,
    MemoryBudget,
    ModelCard,
    OptimRequest,
    PassPart,
    PassRequest,
    PassResult,
    SampledSequence,
    SampleRequest,
    SampleResult,
)
from lockstep.errors import UserInputError

VOCAB = 64
DIM = 4


def card(directory: Path) -> ModelCard:
    return ModelCard(
        name="Fake/arithmetic",
        directory=str(directory),
        arch="arithmetic",
        vocab_size=VOCAB,
        max_context_length=256,
        eos_token_id=None,
    )


def features(data: list[Datum] | list[list[int]]) -> np.ndarray:
    """The gradient contribution of one request's data (also what its loss is a dot with)."""
    f = np.zeros(DIM)
    for d in data:
        tokens = d.tokens if isinstance(d, Datum) else np.asarray(d[:-1])
        f += [tokens.mean() / VOCAB, len(tokens) / 16.0, (tokens % 7).sum() / 32.0, 1.0]
    return f


def initial_weights(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=DIM)


def weights_token(w: np.ndarray) -> int:
    """The one token the fake sampler answers with: a function of the adapter's exact bits."""
    return zlib.crc32(np.asarray(w, dtype=np.float64).tobytes()) % VOCAB


@dataclass
class _State:
    w: np.ndarray
    g: np.ndarray = field(default_factory=lambda: np.zeros(DIM))
    undo: np.ndarray | None = None  # g before the FIRST part of a request run in parts


def _write(directory: Path, w: np.ndarray) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "weights.json").write_text(json.dumps([float(x) for x in w]))
    return (directory / "weights.json").stat().st_size


def read_weights(directory: Path) -> np.ndarray:
    return np.asarray(json.loads((directory / "weights.json").read_text()), dtype=np.float64)


class ArithmeticTrainingEngine(TrainingEngine):
    def __init__(self, directory: Path) -> None:
        self._card = card(directory)
        self.models: dict[str, _State] = {}
        self.die_at_next_pass = False
        # Fault injection: any pass holding this token kills the engine (a poison request).
        self.poison_token: int | None = None
        # Fault injection: a request holding this token fails (its own error, like a NaN loss).
        self.fail_token: int | None = None
        self.dead = False  # like a dead process: every call fails until restart()
        self.restarts = 0
        self.passes_run = 0  # calls of run_passes that returned
        self.in_flight: list[tuple[str, Path]] = []  # background snapshots being written
        self.ready: list[tuple[str, Path]] = []  # written; reported at the next call
        self._lock = threading.Lock()

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> TrainerCapabilities:
        return TrainerCapabilities("arithmetic")  # built-in losses on text

    def memory_budget(self) -> MemoryBudget:
        return NO_MEMORY_LIMIT

    def create_model(self, model_id: str, spec: LoraSpec) -> None:
        self._check_alive()
        self.models[model_id] = _State(initial_weights(spec.seed or 0))

    def delete_model(self, model_id: str) -> None:
        self.models.pop(model_id, None)

    def has_model(self, model_id: str) -> bool:
        return model_id in self.models

    def run_passes(self, requests: list[PassRequest]) -> list[PassResult]:
        with self._lock:
            if self.die_at_next_pass:
                self.die_at_next_pass, self.dead = False, True
        self._check_alive()
        if self.poison_token is not None and any(
            self.poison_token in d.tokens for r in requests for d in r.data
        ):
            self.dead = True
            raise EngineDied("fake engine killed by a poison row (signal 9)")
        for r in requests:  # validate everything first: a failed call leaves no gradient
            if r.model_id not in self.models:
                raise UserInputError("model_id", f"{r.model_id} is not resident")
            if self.fail_token is not None and any(self.fail_token in d.tokens for d in r.data):
                raise UserInputError("data", "fake engine: a datum holds the failing token")
            undone = r.part is PassPart.MIDDLE or r.part is PassPart.LAST
            if undone and not r.forward_only and self.models[r.model_id].undo is None:
                raise RuntimeError(f"fake engine: {r.request_id} lost its first part")
        results = []
        for r in requests:
            state, f = self.models[r.model_id], features(r.data)
            if not r.forward_only:
                if r.part is PassPart.FIRST:  # the undo point of a request run in parts
                    state.undo = state.g
                state.g = state.g + f
                if r.part is PassPart.LAST:
                    state.undo = None
            outputs = [{"logprobs": np.zeros(len(d.tokens), np.float32)} for d in r.data]
            results.append(PassResult(r.request_id, outputs, {"loss:sum": float(state.w @ f)}))
        self.passes_run += 1
        return results

    def undo_parts(self, model_id: str) -> None:
        state = self.models.get(model_id)
        if state is not None and state.undo is not None:
            state.g, state.undo = state.undo, None

    def optim_step(self, requests: list[OptimRequest]) -> dict[str, dict[str, float]]:
        self._check_alive()
        out = {}
        for r in requests:
            state = self.models[r.model_id]
            out[r.model_id] = {"grad_norm:mean": float(np.linalg.norm(state.g))}
            state.w = state.w - r.adam.learning_rate * state.g
            state.g = np.zeros(DIM)
        return out

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> int:
        self._check_alive()
        return _write(directory, self.models[model_id].w)

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        self._check_alive()
        self.models[model_id] = _State(read_weights(directory))
        return LoraSpec(rank=1)

    def export_adapter(self, model_id: str, directory: Path) -> int:
        self._check_alive()
        return _write(directory, self.models[model_id].w)

    def _check_alive(self) -> None:
        if self.dead:
            raise EngineDied("fake engine killed by the test")

    def alive(self) -> bool:
        return not self.dead

    def snapshot(self, model_id: str, directory: Path) -> bool:
        """Like a background writer that lags: reported durable only by the second
        `durable_snapshots` call after it, and lost if the engine dies first (so every step
        since the recorded snapshot must be replayable from the log)."""
        self._check_alive()
        _write(directory, self.models[model_id].w)
        self.in_flight.append((model_id, directory))
        return False

    def durable_snapshots(self) -> list[tuple[str, Path]]:
        self._check_alive()
        done, self.ready, self.in_flight = self.ready, self.in_flight, []
        return done

    def restart(self) -> None:
        self.models.clear()  # like a fresh process: every tenant's state is gone
        self.in_flight, self.ready = [], []  # background snapshots in flight are lost
        self.dead = False
        self.restarts += 1


class ArithmeticSamplingEngine(SamplingEngine):
    def __init__(self, directory: Path) -> None:
        self._card = card(directory)
        self.adapters: dict[str, np.ndarray] = {}
        # Fault injection: any batch holding a prompt with this token kills the sampler.
        self.poison_token: int | None = None
        self.dead = False  # like a dead process: every sample fails until restart()
        self.restarts = 0

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> SamplerCapabilities:
        return SamplerCapabilities("arithmetic")

    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        self.adapters[adapter_id] = read_weights(directory)

    def unload_adapter(self, adapter_id: str) -> None:
        self.adapters.pop(adapter_id, None)

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        if self.dead:
            raise EngineDied("fake sampler killed by the test")
        if self.poison_token is not None and any(self.poison_token in r.prompt for r in requests):
            self.dead = True
            raise EngineDied("fake sampler killed by a poison prompt (signal 9)")
        out = []
        for r in requests:
            if r.adapter_id is None:  # the base model: weights 0, so its answer is the prompt's sum
                seq = SampledSequence([sum(r.prompt)], [0.0], "length")
                out.append(SampleResult(r.request_id, [seq] * r.num_samples))
                continue
            w = self.adapters.get(r.adapter_id)
            if w is None:
                out.append(SampleResult(r.request_id, [], error=f"{r.adapter_id} not loaded"))
                continue
            seq = SampledSequence([weights_token(w)], [0.0], "length")
            out.append(SampleResult(r.request_id, [seq] * r.num_samples))
        return out

    def restart(self) -> None:
        self.adapters.clear()  # like a fresh process: adapters are loaded again on demand
        self.dead = False
        self.restarts += 1
