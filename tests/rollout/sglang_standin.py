"""SGLang stand-in: a real HTTP server (FastAPI + uvicorn) that implements the request and
response shapes of SGLang's native API, because SGLang itself cannot run on these machines (no
CPU build, and its GPU wheels exceed what the GPU box can take; docs/deploy.md).

It is a stand-in for the SERVER only: the numbers are real, computed by Lockstep's own local
sampler (fp32 torch) on the same model and PEFT adapter directories. Routes and shapes follow
SGLang's http_server.py / io_struct.py: /health, /generate, /load_lora_adapter,
/unload_lora_adapter, /release_memory_occupation, /resume_memory_occupation. Like SGLang with
--max-loaded-loras N, it refuses to load an adapter when N are loaded, and while its memory is
released it cannot generate.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lockstep.engine.types import SampleParams, SampleRequest
from lockstep.errors import UserInputError
from lockstep.rollout.local import LocalSamplingEngine


@dataclass
class StandinState:
    engine: LocalSamplingEngine
    max_loaded: int
    loaded: dict[str, str] = field(default_factory=dict)
    released: bool = False
    calls: list[str] = field(default_factory=list)  # route names, in order


def build_app(state: StandinState) -> FastAPI:
    app = FastAPI(title="SGLang stand-in")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    @app.post("/load_lora_adapter")
    async def load(body: dict[str, Any]) -> JSONResponse:
        state.calls.append("load_lora_adapter")
        name, path = body["lora_name"], body["lora_path"]
        if name in state.loaded:
            return _fail(f"LoRA adapter {name} already loaded")
        if len(state.loaded) >= state.max_loaded:
            return _fail(f"max_loaded_loras={state.max_loaded} reached")
        try:
            state.engine.load_adapter(name, Path(path))
        except UserInputError as exc:
            return _fail(str(exc))
        state.loaded[name] = path
        return JSONResponse(
            {"success": True, "error_message": "", "loaded_adapters": dict(state.loaded)}
        )

    @app.post("/unload_lora_adapter")
    async def unload(body: dict[str, Any]) -> JSONResponse:
        state.calls.append("unload_lora_adapter")
        name = body["lora_name"]
        if state.loaded.pop(name, None) is None:
            return _fail(f"LoRA adapter {name} is not loaded")
        state.engine.unload_adapter(name)
        return JSONResponse(
            {"success": True, "error_message": "", "loaded_adapters": dict(state.loaded)}
        )

    @app.post("/release_memory_occupation")
    async def release(body: dict[str, Any]) -> JSONResponse:
        state.calls.append("release_memory_occupation")
        state.released = True
        return JSONResponse({"success": True, "message": ""})

    @app.post("/resume_memory_occupation")
    async def resume(body: dict[str, Any]) -> JSONResponse:
        state.calls.append("resume_memory_occupation")
        state.released = False
        return JSONResponse({"success": True, "message": ""})

    @app.post("/generate")
    async def generate(request: Request) -> JSONResponse:
        state.calls.append("generate")
        if state.released:
            return JSONResponse({"error": {"message": "memory released"}}, status_code=503)
        body = await request.json()
        rows = body["input_ids"]
        single = bool(rows) and isinstance(rows[0], int)
        rows = [rows] if single else rows
        loras = body.get("lora_path")
        loras = loras if isinstance(loras, list) else [loras] * len(rows)
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(rows)
        for lora in loras:
            if lora is not None and lora not in state.loaded:
                return _fail(f"LoRA adapter {lora} is not loaded")
        start = int(body.get("logprob_start_len", -1))
        k = int(body.get("top_logprobs_num", 0))
        requests = [
            _request(i, row, lora, sp, start, k)
            for i, (row, lora, sp) in enumerate(zip(rows, loras, params, strict=True))
        ]
        results = state.engine.sample(requests)
        outs = []
        for row, res, req in zip(rows, results, requests, strict=True):
            if res.error is not None:
                return _fail(res.error)
            seq = res.sequences[0]
            meta: dict[str, Any] = {
                "id": res.request_id,
                "prompt_tokens": len(row),
                "completion_tokens": len(seq.tokens),
                "finish_reason": {"type": seq.stop_reason},
                "output_token_logprobs": [
                    [lp, t, None] for lp, t in zip(seq.logprobs, seq.tokens, strict=True)
                ],
                "output_top_logprobs": [
                    [[lp, t, None] for t, lp in zip(ids, lps, strict=True)]
                    for ids, lps in zip(seq.topk_ids or [], seq.topk_logprobs or [], strict=True)
                ],
            }
            if req.prompt_logprobs:
                lps = res.prompt_logprobs or []
                meta["input_token_logprobs"] = [
                    [None if math.isnan(lp) else lp, t, None]
                    for lp, t in zip(lps, row, strict=True)
                ]
                meta["input_top_logprobs"] = [
                    None if top is None else [[lp, t, None] for t, lp in top]
                    for top in (res.topk_prompt or [None] * len(row))
                ]
            outs.append({"text": "", "output_ids": seq.tokens, "meta_info": meta})
        return JSONResponse(outs[0] if single else outs)

    return app


def _fail(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "error_message": message}, status_code=400)


def _request(
    i: int, row: list[int], lora: str | None, sp: dict[str, Any], start: int, k: int
) -> SampleRequest:
    top_k = int(sp.get("top_k", -1))
    params = SampleParams(
        max_tokens=int(sp.get("max_new_tokens", 128)),
        seed=sp.get("sampling_seed"),
        temperature=float(sp.get("temperature", 1.0)),
        top_k=top_k if top_k > 0 else -1,
        top_p=float(sp.get("top_p", 1.0)),
        stop_strings=tuple(sp.get("stop") or ()),
        stop_tokens=tuple(sp.get("stop_token_ids") or ()),
        stop_at_eos=not sp.get("ignore_eos", False),
    )
    return SampleRequest(
        request_id=str(i),
        adapter_id=lora,
        prompt=list(row),
        num_samples=1,
        params=params,
        prompt_logprobs=start == 0,
        topk_prompt_logprobs=k if start == 0 else 0,
        topk_sample_logprobs=k,
    )


class StandinServer:
    """Serves the app on a free loopback port in a background thread."""

    def __init__(self, state: StandinState) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            build_app(state), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> StandinServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("SGLang stand-in did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
