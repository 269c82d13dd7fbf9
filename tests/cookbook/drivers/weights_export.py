"""Turn Lockstep checkpoints into merged HF models and PEFT adapters with tinker-cookbook's own
`weights` tools (cookbook venv, package unmodified), and read the base and merged models with the
cookbook venv's own transformers.

Usage: python weights_export.py '<json config>' with key jobs, a list of objects with keys
base_model (a local model directory), adapter_path, out_dir, peft (bool: also build the PEFT
adapter) and tokens (lists of token ids). Writes out_dir/merged (fp32), with peft out_dir/peft,
and out_dir/logprobs.json: {"base": [...], "merged": [...]}, each token's logprob of the next
one under the base and the merged model, per token list.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from tinker_cookbook import weights
from transformers import AutoModelForCausalLM


def logprobs(directory: Path, rows: list[list[int]]) -> list[list[float]]:
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    out = []
    for row in rows:
        ids = torch.tensor(row)
        with torch.no_grad():
            logits = model(ids[None, :-1]).logits[0].float()
        out.append(logits.log_softmax(-1).gather(-1, ids[1:, None])[:, 0].tolist())
    return out


def run(job: dict) -> None:
    out = Path(job["out_dir"])
    weights.build_hf_model(
        base_model=job["base_model"],
        adapter_path=job["adapter_path"],
        output_path=str(out / "merged"),
        dtype="float32",
    )
    if job["peft"]:
        weights.build_lora_adapter(
            base_model=job["base_model"],
            adapter_path=job["adapter_path"],
            output_path=str(out / "peft"),
        )
    result = {
        "base": logprobs(Path(job["base_model"]), job["tokens"]),
        "merged": logprobs(out / "merged", job["tokens"]),
    }
    (out / "logprobs.json").write_text(json.dumps(result))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1])["jobs"]:
        run(job)
