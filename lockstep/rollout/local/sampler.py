"""`LocalSamplingEngine`: the in-process torch sampler (base model + many LoRA adapters).

Adapters come from PEFT directories written by the trainer. At most `max_adapters` are resident
in the LoRA model (least recently used evicted first); an evicted adapter is reloaded from its
directory, transparently, the next time a request uses it. A `sample` batch that needs more
distinct adapters than fit is served in several consecutive sub-batches.

`sample_slice` runs generations a slice of decode steps at a time: each call starts the new
requests (prefilled together, as one `Generation`) and moves the running generations on for at
most `steps` steps, returning as soon as a request finishes (it is answered at once), so a long
generation never holds a short one for its whole length. Generations near their end (a short
sample) take their steps first while longer ones take one step per call (`_decode_steps`);
otherwise each takes a step in turn. Each
generation decodes in its own batches, exactly as it would have to the end in one call. The
adapters of running generations stay loaded until they finish (an unload waits for them).

Weights: `dtype` (bf16 on CUDA by default) for the base model; adapters stay fp32 as in the
trainer; every logprob comes from fp32 logits. Decode: `decode="static"` runs the padded path's
steps over a fixed-capacity KV cache, as CUDA graphs on CUDA (`static_kv`); what a model cannot
run that way is logged at start and reported by `capabilities()`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lockstep.config.sections import SamplerDecode
from lockstep.config.training import DtypeName
from lockstep.engine.capabilities import TEXT_AND_IMAGES, TEXT_INPUTS, SamplerCapabilities
from lockstep.engine.interface import SamplingEngine
from lockstep.engine.types import LoraSpec, ModelCard, SampleRequest, SampleResult
from lockstep.errors import UserInputError
from lockstep.modeling import hybrid_kernels, mixers
from lockstep.modeling.architecture import describe
from lockstep.modeling.loader import default_device, load_base_model, resolve_dtype
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import load_peft_adapter
from lockstep.modeling.vision.tower import VisionModel
from lockstep.rollout.local.generate import GenerateConfig, Generator
from lockstep.rollout.local.generation import Generation
from lockstep.rollout.local.prompt_images import PromptImages
from lockstep.rollout.local.static_kv import graph_refusal, static_refusal
from lockstep.rollout.pager import AdapterPager

log = logging.getLogger(__name__)
# A generation this many slices from its end or nearer decodes ahead of longer ones
# (`_decode_steps`).
SHORT_SLICES = 2


def _eos_ids(card: ModelCard, generation_eos: int | Iterable[int] | None) -> frozenset[int]:
    ids: set[int] = set()
    if card.eos_token_id is not None:
        ids.add(card.eos_token_id)
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


class LocalSamplingEngine(SamplingEngine):
    """Samples from the base model in `model_dir` with any loaded adapter, in-process.

    `dtype`: the base weights' (None: bfloat16 on CUDA, float32 elsewhere); adapters stay fp32
    (the trainer's policy) and logprobs come from fp32 logits. `decode`: "static" decodes the
    padded path over a fixed-capacity cache (`static_kv`); a model that cannot logs why and
    decodes eagerly (`capabilities().decode_fallback`).
    """

    def __init__(
        self,
        model_dir: Path,
        served_name: str,
        max_adapters: int = 64,
        *,
        device: torch.device | str | None = None,
        dtype: DtypeName | None = None,
        decode: SamplerDecode = "eager",
        max_batch_rows: int = 256,
        prefill_token_budget: int = 8192,
    ) -> None:
        dev = torch.device(device) if device is not None else default_device()
        weights = resolve_dtype(dtype, dev)
        base, self._card = load_base_model(model_dir, served_name, dev, weights)
        self._dtype = str(weights).removeprefix("torch.")
        # Describes the model; refuses what it cannot compute.
        self._lora = LoraModel(base, describe(base, self._card.vision))
        # transformers' own layers pick their hybrid kernels: reported, a failing one refused.
        recurrent = [base.get_submodule(m) for m in self._lora.arch.row_mixers]
        self._kernels = (
            hybrid_kernels.in_transformers(mixers.shapes(recurrent), dev, weights)
            if recurrent
            else ()
        )
        vision = self._lora.arch.vision  # a vision-language model: prefill with image embeddings
        self._fallback = None
        if decode == "static":
            self._fallback = static_refusal(self._lora.arch.padded_sampling, vision is not None)
            if self._fallback is not None:
                log.info("sampler: %s decodes eagerly: %s", served_name, self._fallback)
        static = decode == "static" and self._fallback is None
        self._decode: SamplerDecode = "static" if static else "eager"
        no_graphs = graph_refusal(dev) if static else None
        if static and no_graphs is not None and dev.type == "cuda":
            log.info("sampler: %s: static decode steps run eagerly: %s", served_name, no_graphs)
        self._graphs = static and no_graphs is None
        images = None if vision is None else PromptImages(VisionModel(base, model_dir, vision))
        self._tokenizer = AutoTokenizer.from_pretrained(self._card.directory)
        self._tokenizer_size = len(self._tokenizer)
        generation = getattr(base, "generation_config", None)
        eos_ids = _eos_ids(self._card, getattr(generation, "eos_token_id", None))
        pad = getattr(base.config, "pad_token_id", None)
        pad_id = pad if isinstance(pad, int) else (self._card.eos_token_id or 0)
        self._generator = Generator(
            self._lora,
            GenerateConfig(
                eos_ids=eos_ids,
                pad_id=pad_id,
                decode=self.decode,
                prefill_token_budget=prefill_token_budget,
                padded=self._lora.arch.padded_sampling,
                static_decode=static,
                cuda_graphs=self._graphs,
            ),
            images,
        )
        self._pager = AdapterPager(max_adapters)
        self._max_batch_rows = max_batch_rows
        self._lock = threading.RLock()
        self._running: list[Generation] = []  # started by sample_slice, not finished
        self._waiting: list[SampleRequest] = []  # their adapters do not fit beside those yet
        self._unload_later: set[str] = set()  # unloaded while a running generation used them

    # -- SamplingEngine -------------------------------------------------------------------

    def card(self) -> ModelCard:
        return self._card

    def capabilities(self) -> SamplerCapabilities:
        return SamplerCapabilities(
            "local",
            TEXT_AND_IMAGES if self._card.vision is not None else TEXT_INPUTS,
            dtype=self._dtype,
            decode=self._decode,
            decode_fallback=self._fallback,
            cuda_graphs=self._graphs,
            kernels=self._kernels,
        )

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer of the model directory (used for stop strings)."""
        return self._tokenizer

    def load_adapter(self, adapter_id: str, directory: Path) -> None:
        """Load (or replace) `adapter_id` from a PEFT directory; a no-op when already loaded
        from the same directory.

        Raises:
            UserInputError: the directory is not a LoRA adapter of this base model.
        """
        directory = Path(directory)
        with self._lock:
            self._unload_later.discard(adapter_id)
            if self._pager.is_loaded(adapter_id, directory):
                self._pager.touch([adapter_id])
                return
            self._generator.prefix_cache.forget_adapter(adapter_id)  # new weights, new KV
            try:
                self._install(adapter_id, directory, keep=())
            except (OSError, ValueError) as exc:
                message = f"cannot load adapter from {directory}: {exc}"
                raise UserInputError("path", message) from exc
            self._pager.remember(adapter_id, directory)
            for generation in self._running:  # a captured step reads the old weights
                generation.drop_graphs()

    def unload_adapter(self, adapter_id: str) -> None:
        with self._lock:
            if self._pager.forget(adapter_id):
                if adapter_id in self._in_use():
                    self._unload_later.add(adapter_id)  # its running generations finish first
                else:
                    self._lora.remove_adapter(adapter_id)
            self._generator.prefix_cache.forget_adapter(adapter_id)

    def sample(self, requests: list[SampleRequest]) -> list[SampleResult]:
        with self._lock:
            results: list[SampleResult | None] = [None] * len(requests)
            valid: list[int] = []
            for i, req in enumerate(requests):
                try:
                    self._check_adapter(req)
                    valid.append(i)
                except UserInputError as exc:
                    results[i] = SampleResult(req.request_id, [], error=str(exc))
            for chunk in self._pager.chunks(requests, valid, self._max_batch_rows):
                failed = self._make_resident({requests[i].adapter_id for i in chunk} - {None})
                runnable = []
                for i in chunk:
                    message = failed.get(requests[i].adapter_id)
                    if message is None:
                        runnable.append(i)
                    else:
                        results[i] = SampleResult(requests[i].request_id, [], error=message)
                if not runnable:
                    continue
                with torch.inference_mode():
                    outputs = self._generator.run([requests[i] for i in runnable])
                for i, out in zip(runnable, outputs, strict=True):
                    results[i] = out
            assert all(r is not None for r in results)
            return [r for r in results if r is not None]

    def sample_slice(self, requests: list[SampleRequest], steps: int) -> list[SampleResult]:
        """Start `requests`, then move every running generation on by at most `steps` decode
        steps; the results of the requests that finished (module docstring)."""
        with self._lock:
            finished: list[SampleResult] = []
            for req in requests:
                try:
                    self._check_adapter(req)
                    self._waiting.append(req)
                except UserInputError as exc:
                    finished.append(SampleResult(req.request_id, [], error=str(exc)))
            try:
                finished += self._start_waiting()
                with torch.inference_mode():
                    finished += self._decode_steps(steps)
            except BaseException:  # the interface's promise: nothing half-run stays behind
                self._running, self._waiting = [], []
                raise
            self._running = [g for g in self._running if not g.finished]
            for adapter_id in self._unload_later - self._in_use():
                self._lora.remove_adapter(adapter_id)
                self._unload_later.discard(adapter_id)
            return finished

    def _decode_steps(self, steps: int) -> list[SampleResult]:
        """At most `steps` decode steps of the running generations, until a request finishes.
        Generations that can finish within `SHORT_SLICES` slices go first, and the others take
        one step each per call meanwhile: a short sample beside a long generation is answered
        about a slice after it arrives instead of sharing every decode step with it, and the
        long one still moves at every call. Otherwise a step of each in turn. Each generation
        decodes in its own batches, so the order changes no number."""
        short = [g for g in self._running if g.remaining() <= SHORT_SLICES * steps]
        others = [g for g in self._running if g.remaining() > SHORT_SLICES * steps]
        turns = short if short and others else self._running
        finished: list[SampleResult] = []
        for _ in range(steps):
            for generation in turns:
                finished += self._generator.advance(generation, 1)
            if finished:
                break
        if turns is short:
            for generation in others:
                finished += self._generator.advance(generation, 1)
        return finished

    def _start_waiting(self) -> list[SampleResult]:
        """Start the waiting requests whose adapters fit beside the running generations'."""
        failed: list[SampleResult] = []
        waiting, self._waiting = self._waiting, []
        for chunk in self._pager.chunks(waiting, list(range(len(waiting))), self._max_batch_rows):
            batch = [waiting[i] for i in chunk]
            wanted = {r.adapter_id for r in batch if r.adapter_id is not None}
            if self._running and len(wanted | self._in_use()) > self._pager.max_adapters:
                self._waiting += batch  # after some running generation finishes
                continue
            errors = self._make_resident(set(wanted))
            failed += [
                SampleResult(r.request_id, [], error=errors[r.adapter_id])
                for r in batch
                if r.adapter_id in errors
            ]
            runnable = [r for r in batch if r.adapter_id not in errors]
            if runnable:
                with torch.inference_mode():
                    self._running.append(self._generator.start(runnable))
        return failed

    def _in_use(self) -> set[str]:
        return {a for g in self._running for a in g.adapters()}

    def close(self) -> None:
        with self._lock:
            for adapter_id in self._pager.forget_all():
                self._lora.remove_adapter(adapter_id)

    # -- adapters -------------------------------------------------------------------------

    def prefill_counts(self) -> tuple[int, int]:
        """(prompt tokens prefilled, prompt tokens reused from session prefix caches) so far."""
        with self._lock:
            return self._generator.prefilled_tokens, self._generator.reused_tokens

    def graph_failure(self) -> str | None:
        """Why capturing a static decode step as a CUDA graph failed (then every later step ran
        eagerly); None: it did not fail, or was never tried."""
        with self._lock:
            static = self._generator.static
            return None if static is None else static.graph_failure

    def resident_adapters(self) -> list[str]:
        """Adapters currently in memory (in no particular order)."""
        with self._lock:
            return self._pager.loaded()

    def _install(self, adapter_id: str, directory: Path, keep: Iterable[str]) -> None:
        """Read `directory` into the LoRA model, paging out LRU adapters (never those in `keep`)."""
        adapter = load_peft_adapter(directory)
        state = adapter.state
        spec = self._lora.spec_of(state, adapter.rank, adapter.alpha)
        for victim in self._pager.admit(adapter_id, directory, keep):
            self._lora.remove_adapter(victim)
        try:
            self._load_state(adapter_id, state, spec)
        except BaseException:
            self._pager.unloaded(adapter_id)
            raise

    def _load_state(self, adapter_id: str, state: dict[str, torch.Tensor], spec: LoraSpec) -> None:
        with torch.no_grad():
            self._lora.load_adapter_state(adapter_id, state, spec)
            for param in self._lora.adapter_parameters(adapter_id):
                param.requires_grad_(False)

    def _make_resident(self, adapter_ids: set[str | None]) -> dict[str | None, str]:
        """Ensure every adapter of a chunk is in memory; returns adapter_id -> error message."""
        failed: dict[str | None, str] = {}
        wanted = sorted(a for a in adapter_ids if a is not None)
        keep = [*wanted, *self._in_use()]  # running generations' adapters stay loaded
        self._pager.touch(keep)
        for adapter_id in wanted:
            if self._pager.is_loaded(adapter_id):
                continue
            directory = self._pager.directory(adapter_id)
            try:
                self._install(adapter_id, directory, keep=keep)
            except (OSError, ValueError) as exc:
                failed[adapter_id] = (
                    f"adapter_id: cannot reload {adapter_id!r} from {directory}: {exc}"
                )
        return failed

    # -- validation -----------------------------------------------------------------------

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of `tokens` as stop strings see it (special tokens kept; ids the tokenizer does
        not know, possible when the embedding table is larger, are skipped)."""
        known = [t for t in tokens if 0 <= t < self._tokenizer_size]
        return str(
            self._tokenizer.decode(
                known, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )

    def _check_adapter(self, req: SampleRequest) -> None:
        """Its adapter must be known (the rest of an admitted request was judged by the
        scheduler's admission: engines trust it)."""
        if req.adapter_id is not None and not self._pager.knows(req.adapter_id):
            raise UserInputError("adapter_id", f"unknown adapter {req.adapter_id!r} (not loaded)")
