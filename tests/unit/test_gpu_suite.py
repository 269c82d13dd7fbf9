"""benchmarks/gpu_suite.py runs end to end on a CPU with --smoke (tiny shapes): every section it
is asked for writes results and no error, the kernel variants agree with the default path in
fp32, and the profile is written. The GPU numbers themselves come from a GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTIONS = [
    "device",
    "compat",
    "dense",
    "fits",
    "moe",
    "dense_sampler",
    "head",
    "attention",
    "experts",
    "hybrid_kernels",
]


def test_gpu_suite_smoke_runs_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [
        sys.executable,
        "benchmarks/gpu_suite.py",
        "--smoke",
        "--profile",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(
        [*cmd, "--sections", *SECTIONS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert results["mode"] == "smoke" and results["environment"]["git_rev"]
    libraries = results["environment"]["libraries"]  # what the numbers were taken with
    assert libraries["torch"] and libraries["transformers"]
    sections = results["sections"]
    assert sorted(sections) == sorted(SECTIONS)
    for name, section in sections.items():
        assert "error" not in section and "skipped" not in section, (name, section)
    for family in ("dense", "moe"):
        s = sections[family]
        assert s["packed_tokens_per_s"] > 0 and s["sequential_tokens_per_s"] > 0
        assert 0 < s["flops_per_token_no_attention"] < s["flops_per_token"]
        assert 0 < s["flops_per_token_head"] < s["flops_per_token"] and s["head_s"] > 0
        assert 0 < s["layer_stack_mfu"] and 0 < s["lora_mfu"]  # the head's time set apart
        assert s["small_rows"]["packed_over_one_tenant_per_cycle"] > 0
        # fp32 on a CPU: the fused head (and the per-group expert matmuls) equal the default
        for variant, result in s["variants"].items():
            assert result.get("max_abs_logprob_diff", 0.0) < 1e-4, (family, variant, result)
        assert "chunked_head" in s["variants"]
    moe_variants = set(sections["moe"]["variants"])
    assert {"per_group_expert_matmul", "per_adapter_expert_lora"} <= moe_variants
    compat = sections["compat"]["imported"]  # every family trains; 2048 groups equal alone
    assert compat["qwen3_moe_256_experts"]["alone_vs_packed_max_abs_logprob_diff"] < 1e-5
    assert {"qwen3", "qwen3_moe", "nemotron_h"} <= set(compat)
    assert not [f for f, r in compat.items() if isinstance(r, dict) and "error" in r]
    fits = sections["fits"]  # on a CPU the code path only: no 40 GiB limit to keep under
    assert fits["packed_tokens_per_s"] > 0 and fits["over_unconstrained"] > 0
    sampler = sections["dense_sampler"]
    assert sampler["with_adapter"] and sampler["generated_tokens"] == 8 * 4 * 8
    static = sampler["variants"]["static_auto"]  # fp32 on a CPU: the static decode's tokens
    assert (static["decode"], static["dtype"], static["cuda_graphs"]) == (
        "static",
        "float32",
        False,
    )
    assert static["generated_tokens"] == 8 * 4 * 8 and sampler["speedup"] > 0
    assert sampler["static_vs_eager"]["same_tokens_share"] == 1.0
    assert sampler["static_vs_eager"]["max_abs_logprob_diff"] < 1e-5
    assert 0 < sampler["roofline"]["roofline_share"]  # generated tokens/s over the HBM bound
    for case in ("no_head_lora", "head_lora"):
        assert sections["head"][case]["max_abs_diff_hidden_grad"] < 1e-4
    for case in ("8x16", "8x8"):  # fp32 on a CPU: the grouped (adapter, expert) LoRA equals
        experts = sections["experts"][case]
        assert experts["max_abs_diff_out"] <= 1e-6 * experts["max_abs_out"], experts
        assert experts["max_abs_diff_adapter_grad"] < 1e-6, experts
    assert "varlen" in sections["attention"]["uniform_16x512_window0"]  # not on a CPU: said so
    hybrid = sections["hybrid_kernels"]  # no fla on a CPU: the reference timed, and why
    for model, kernels in (("qwen3_6", "gated_delta_rule"), ("nemotron3", "mamba2_scan")):
        assert hybrid[model][kernels]["reference_s"], hybrid
        assert hybrid[model]["choice"][kernels][0] == "reference", hybrid
    assert results["summary"] and "top" not in results  # the headline table was built
    assert (tmp_path / "gpu_suite_profile.txt").read_text().count("== ") == 2  # dense, moe
