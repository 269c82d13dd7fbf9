"""What the external samplers share (rollout/remote.py, rollout/launcher.py): both servers'
launch flags, error messages and prompt-logprob layouts read into one result shape. The
servers themselves run in tests/rollout/ (SGLang stand-in) and test_vllm_sampler.py."""

from __future__ import annotations

import math
from pathlib import Path

import httpx

from lockstep.engine.types import SampleParams, SampleRequest, SampleResult
from lockstep.rollout.remote import server_message
from lockstep.rollout.sglang.sampler import SglangLaunchConfig
from lockstep.rollout.sglang.sampler import _prompt_logprobs as sglang_prompt
from lockstep.rollout.vllm.sampler import VllmLaunchConfig
from lockstep.rollout.vllm.sampler import _prompt_logprobs as vllm_prompt


def _pairs(argv: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}


def test_both_servers_start_with_the_common_flags_and_their_own() -> None:
    common = dict(python=Path("/py"), model_dir=Path("/m"), served_name="tiny", max_loras=3)
    vllm = VllmLaunchConfig(**common, max_lora_rank=8, sleep_mode=True)  # type: ignore[arg-type]
    sglang = SglangLaunchConfig(**common, max_lora_rank=8)  # type: ignore[arg-type]
    for config, model_flag, own in (
        (vllm, "--model", {"--max-loras": "3", "--logprobs-mode": "processed_logprobs"}),
        (sglang, "--model-path", {"--max-loras-per-batch": "3", "--max-loaded-loras": "3"}),
    ):
        flags = _pairs(config.argv(4321))
        assert flags[model_flag] == "/m" and flags["--served-model-name"] == "tiny"
        assert flags["--port"] == "4321" and flags["--dtype"] == "float32"
        assert flags["--max-lora-rank"] == "8" and "--enable-lora" in config.argv(1)
        assert own.items() <= flags.items()
        assert config.env()["HF_HUB_OFFLINE"] == "1" and config.env()["PYTHONPATH"] == ""
    assert "--enable-sleep-mode" in vllm.argv(1)
    assert vllm.env()["VLLM_SERVER_DEV_MODE"] == "1"
    assert sglang.env()["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"
    assert (vllm.log_file.name, sglang.log_file.name) == ("vllm.log", "sglang.log")


def test_server_messages_in_either_shape() -> None:
    def reply(body: object) -> httpx.Response:
        return httpx.Response(400, json=body)

    assert server_message(reply({"error": {"message": "bad top_k"}})) == "bad top_k"  # vLLM
    assert server_message(reply({"success": False, "error_message": "no lora"})) == "no lora"
    assert server_message(reply({"message": "plain"})) == "plain"
    assert server_message(httpx.Response(500, text="boom")) == "boom"


def _request() -> SampleRequest:
    return SampleRequest(
        "r", None, [5, 6, 7], 1, SampleParams(max_tokens=0), True, topk_prompt_logprobs=1
    )


def test_prompt_logprobs_read_alike_from_both_servers() -> None:
    """The same numbers in each server's layout give the same result: NaN at position 0, each
    later position's logprob of the prompt token, its top-1 alternative."""
    vllm_rows = [
        None,
        {"6": {"logprob": -0.5, "rank": 1}},
        {"7": {"logprob": -2.0, "rank": 3}, "9": {"logprob": -0.1, "rank": 1}},
    ]
    sglang_meta = {
        "input_token_logprobs": [[None, 5, None], [-0.5, 6, None], [-2.0, 7, None]],
        "input_top_logprobs": [None, [[-0.5, 6, None]], [[-0.1, 9, None], [-2.0, 7, None]]],
    }
    results = [SampleResult("r", []), SampleResult("r", [])]
    vllm_prompt(results[0], _request(), vllm_rows)  # type: ignore[arg-type]
    sglang_prompt(results[1], _request(), sglang_meta)
    for result in results:
        assert result.prompt_logprobs is not None and math.isnan(result.prompt_logprobs[0])
        assert result.prompt_logprobs[1:] == [-0.5, -2.0]
        assert result.topk_prompt == [None, [(6, -0.5)], [(9, -0.1)]]
