"""`SglangSamplingEngine`: Lockstep's SamplingEngine over SGLang's native HTTP API.

Request/response shapes follow SGLang's `python/sglang/srt/entrypoints/http_server.py` and
`python/sglang/srt/managers/io_struct.py` (GenerateReqInput, LoadLoRAAdapterReqInput,
UnloadLoRAAdapterReqInput, LoadLoRAAdapterFromTensorsReqInput,
Release/ResumeMemoryOccupationReqInput) and docs.sglang.io "Sampling Parameters" / "LoRA Serving":

* `POST /generate` {input_ids: [[...]] (one row per sample), lora_path: [name, ...],
  sampling_params: [{max_new_tokens, temperature, top_p, top_k, stop, stop_token_ids,
  ignore_eos, sampling_seed, skip_special_tokens, no_stop_trim}, ...], return_logprob,
  logprob_start_len, top_logprobs_num} -> a list of {output_ids, meta_info: {finish_reason:
  {type: "stop"|"length"}, input_token_logprobs: [[logprob|null, token_id, text|null], ...],
  output_token_logprobs, input_top_logprobs, output_top_logprobs}}.
* `POST /load_lora_adapter` {lora_name, lora_path}; `POST /unload_lora_adapter` {lora_name};
  `POST /load_lora_adapter_from_tensors` {lora_name, config_dict, serialized_tensors} (tensors
  in SGLang's own MultiprocessingSerializer format: only when the sglang package imports here).
* `POST /release_memory_occupation` / `/resume_memory_occupation` {tags: null} (colocated mode;
  the server needs --enable-memory-saver). After a resume the LoRA memory pool is re-filled by
  loading the resident adapters again.

A sampled token's logprob is under the distribution it was drawn from (after temperature and
top-k/top-p renormalisation), like the local sampler and hosted Tinker: SGLang's default; a
managed server is started with SGLANG_RETURN_ORIGINAL_LOGPROB=0, an attached one must not set it
to 1 (that returns the raw, temperature-1 logprobs).
"""

from __future__ import annotations

import functools
import json
import logging
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
    ServerError,
    cache_salt,
    fill_prompt_logprobs,
    refused,
    sampling_fields,
    server_message,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SglangLaunchConfig(LaunchConfig):
    """How Lockstep starts `python -m sglang.launch_server` (GPU machines only)."""

    server: ClassVar[str] = "sglang"

    memory_saver: bool = False  # --enable-memory-saver: release/resume around training
    log_file: Path = Path("sglang.log")

    def argv(self, port: int) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_dir),
            *self.common_args(port),
            "--max-loras-per-batch",
            str(self.max_loras),
            "--max-loaded-loras",
            str(self.max_loras),
            "--lora-target-modules",
            "all",
        ]
        if self.memory_saver:
            args.append("--enable-memory-saver")
        return [*args, *self.extra_args]

    def env(self) -> dict[str, str]:
        # logprobs of the sampling distribution (after temperature and truncation)
        return {**super().env(), "SGLANG_RETURN_ORIGINAL_LOGPROB": "0"}


class SglangSamplingEngine(RemoteSamplingEngine):
    engine_name: ClassVar[str] = "sglang"

    @property
    def publish_tensors(self) -> bool:
        """A server this engine started runs on this host: adapters go to it as tensors by
        shared-memory handle (no disk read on its side), where SGLang's serializer imports."""
        return self.server is not None and _serializer() is not None

    # -- phases (colocated mode) -------------------------------------------------------------

    def _release_memory(self) -> bool:
        """Free the server's GPU memory (weights and KV cache) before a training phase."""
        url = self.base_url + "/release_memory_occupation"
        _check(httpx.post(url, json={"tags": None}, timeout=120), "release_memory_occupation")
        return True

    def _resume_memory(self) -> None:
        """Take the memory back; re-send the resident adapters (the LoRA pool was released)."""
        url = self.base_url + "/resume_memory_occupation"
        _check(httpx.post(url, json={"tags": None}, timeout=120), "resume_memory_occupation")
        self._run(self._reload(self._pager.unload_all()))

    async def _reload(self, adapters: list[str]) -> None:
        async with httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout) as client:
            for adapter_id in adapters:
                await self._unload(client, adapter_id)
            await self._make_resident(client, adapters)

    # -- server verbs ------------------------------------------------------------------------

    async def _load(self, client: httpx.AsyncClient, adapter_id: str, directory: Path) -> None:
        if self.publish_tensors:
            response = await client.post(
                "/load_lora_adapter_from_tensors", json=_tensor_payload(adapter_id, directory)
            )
        else:
            response = await client.post(
                "/load_lora_adapter", json={"lora_name": adapter_id, "lora_path": str(directory)}
            )
        if response.status_code == 400:
            message = server_message(response)
            raise UserInputError("path", f"SGLang refused adapter {directory}: {message}")
        _check(response, "load_lora_adapter")

    async def _unload(self, client: httpx.AsyncClient, adapter_id: str) -> None:
        response = await client.post("/unload_lora_adapter", json={"lora_name": adapter_id})
        if response.status_code not in (200, 400):  # 400: not loaded
            _check(response, "unload_lora_adapter")

    async def _generate(self, client: httpx.AsyncClient, req: SampleRequest) -> SampleResult:
        p = req.params
        want_prompt = req.prompt_logprobs or req.topk_prompt_logprobs > 0
        n = req.num_samples
        params = []
        for j in range(n):
            sp: dict[str, Any] = {
                **sampling_fields(p),
                "max_new_tokens": p.max_tokens,
                "no_stop_trim": True,
            }
            if p.seed is not None:
                sp["sampling_seed"] = p.seed + j  # one row per sample: distinct streams
            params.append(sp)
        body = {
            "input_ids": [list(req.prompt)] * n,
            "lora_path": [req.adapter_id] * n,
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": 0 if want_prompt else -1,
            "top_logprobs_num": max(req.topk_sample_logprobs, req.topk_prompt_logprobs),
            "return_text_in_logprobs": False,
        }
        salt = cache_salt(req)
        if salt is not None:  # radix-cache hits only within the request's sampling session
            body["extra_key"] = [salt] * n
        response = await client.post("/generate", json=body)
        if response.status_code == 400:
            return refused(req, response)
        _check(response, "generate")
        outs = response.json()
        outs = outs if isinstance(outs, list) else [outs]
        result = SampleResult(req.request_id, [_sequence(o, req) for o in outs])
        if want_prompt:
            _prompt_logprobs(result, req, outs[0]["meta_info"])
        return result


@functools.cache
def _serializer() -> Any:
    try:  # SGLang's own wire format for tensors; only importable where sglang is installed
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return None
    return MultiprocessingSerializer


def _tensor_payload(adapter_id: str, directory: Path) -> dict[str, Any]:
    """Publish from memory: the adapter's tensors in SGLang's serialized form (no disk read on
    the server side; same host only, as SGLang passes tensors by shared-memory handle)."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    config = json.loads((directory / "adapter_config.json").read_text())
    serialized = _serializer().serialize(tensors, output_str=True)
    return {"lora_name": adapter_id, "config_dict": config, "serialized_tensors": serialized}


def _check(response: httpx.Response, what: str) -> None:
    ok = response.status_code == 200
    if ok:
        try:
            data = response.json()
            ok = not (isinstance(data, dict) and data.get("success") is False)
        except ValueError:
            pass
    if not ok:
        message = server_message(response)
        raise ServerError(f"SGLang {what} failed ({response.status_code}): {message}")


def _sequence(out: dict[str, Any], req: SampleRequest) -> SampledSequence:
    meta = out["meta_info"]
    entries = meta.get("output_token_logprobs") or []
    tokens = [int(e[1]) for e in entries] or [int(t) for t in out.get("output_ids") or []]
    logprobs = [float(e[0]) for e in entries]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, dict) else finish
    stop_reason: StopReason = "stop" if kind == "stop" else "length"
    seq = SampledSequence(tokens, logprobs, stop_reason)
    k = req.topk_sample_logprobs
    if k > 0:
        rows = meta.get("output_top_logprobs") or []
        seq.topk_ids = [[int(e[1]) for e in (row or [])[:k]] for row in rows]
        seq.topk_logprobs = [[float(e[0]) for e in (row or [])[:k]] for row in rows]
    return seq


def _prompt_logprobs(result: SampleResult, req: SampleRequest, meta: dict[str, Any]) -> None:
    """input_token_logprobs[i] is prompt position i (logprob_start_len=0; position 0: null)."""
    values = meta.get("input_token_logprobs") or []
    tops = meta.get("input_top_logprobs") or []

    def logprob(pos: int) -> float | None:
        if pos >= len(values) or values[pos][0] is None:
            return None
        return float(values[pos][0])

    def top(pos: int) -> list[tuple[int, float]] | None:
        if pos >= len(tops) or not tops[pos]:
            return None
        return [(int(e[1]), float(e[0])) for e in tops[pos]]

    fill_prompt_logprobs(result, req, max(len(values), len(tops)), logprob, top)
