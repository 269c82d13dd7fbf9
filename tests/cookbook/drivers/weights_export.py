"""Turn a Lockstep adapter into a merged HF model and a PEFT adapter with tinker-cookbook's own
`weights` tools (cookbook venv, package unmodified).

Usage: python weights_export.py '<json config>' with keys base_model (a local model directory),
adapter_path, out_dir, peft (bool: also build the PEFT adapter). Writes out_dir/merged (fp32)
and, with peft, out_dir/peft.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tinker_cookbook import weights


def main(cfg: dict) -> None:
    out = Path(cfg["out_dir"])
    weights.build_hf_model(
        base_model=cfg["base_model"],
        adapter_path=cfg["adapter_path"],
        output_path=str(out / "merged"),
        dtype="float32",
    )
    if cfg["peft"]:
        weights.build_lora_adapter(
            base_model=cfg["base_model"],
            adapter_path=cfg["adapter_path"],
            output_path=str(out / "peft"),
        )


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
