"""`lockstep demo` end to end, as README's main command runs it (with few steps)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from lockstep.supervisor import free_port

pytestmark = pytest.mark.e2e


def test_demo_trains_three_tenants_in_shared_cycles(tmp_path: Path) -> None:
    """... and with --stay keeps serving after its summary: the console's admin key still sees
    the three runs, until Ctrl-C stops it cleanly."""
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    port = free_port()
    argv = [sys.executable, "-m", "lockstep.cli", "demo", "--data-dir", str(tmp_path / "data")]
    argv += ["--port", str(port), "--steps", "2", "--summary-json", str(summary_path), "--stay"]
    server_log = tmp_path / "data" / "demo-serve.log"
    with (tmp_path / "stderr.txt").open("w+") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        lines: list[str] = []
        for line in proc.stdout:  # until the demo says it keeps serving, or ends
            lines.append(line)
            if line.startswith("still serving: "):
                break
        out = "".join(lines)
        try:
            assert f"still serving: http://127.0.0.1:{port}/console" in out, (
                out + server_log.read_text()[-5000:]
            )
            key = re.search(r"API key (tml-demo-console-[0-9a-f]+)", out)
            assert key is not None, out
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as api:
                api.headers["X-API-Key"] = key.group(1)
                runs = api.get("/api/v1/training_runs?access_scope=accessible").json()
                assert len(runs["training_runs"]) >= 3 and runs["training_runs"][0]["steps"] > 0
                assert api.get("/console").status_code == 200
        finally:
            proc.send_signal(signal.SIGINT)
            rest, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + rest + server_log.read_text()[-5000:]
    with pytest.raises(httpx.ConnectError):  # Ctrl-C stopped the whole server
        httpx.get(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=5)
    summary = json.loads(summary_path.read_text())

    tenants = {t["name"]: t for t in summary["tenants"]}
    assert list(tenants) == ["piglatin", "rl", "capitals"]
    assert [t["rank"] for t in tenants.values()] == [32, 16, 8]
    for t in tenants.values():
        assert t["steps"] == 1 + 2 + 2  # warm-up, then the same steps together and alone
        assert t["together_s_per_step"] > 0 and t["alone_s_per_step"] > 0
        assert t["greedy"] and t["greedy"] in out
    # SFT losses fall over four Adam steps on a fixed batch; the reward is a share of 32 samples.
    assert tenants["piglatin"]["last"] < tenants["piglatin"]["first"]
    assert tenants["capitals"]["last"] < tenants["capitals"]["first"]
    assert 0.0 <= tenants["rl"]["last"] <= 1.0
    assert tenants["piglatin"]["greedy"].startswith("'English: banana split\\nPig Latin:' -> ")

    # Three tenants stepping at once must have shared cycles (the server's own metrics); one
    # after another, the same steps ran in cycles too.
    assert summary["cycles_together"] >= 2 and summary["cycles_one_after_another"] >= 3 * 2
    assert summary["cycles_shared"] >= 1 and summary["tenants_per_cycle"] > 1.0
    assert summary["one_after_another_s"] > 0 and summary["together_s"] > 0
    # The closing lines say what sharing gave: one base model for three tenants (its bytes),
    # the cycles, and the measured time either as a saving or as no saving (never a "cost").
    model_dir = next((tmp_path / "data" / "models").iterdir())
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert summary["base_model_bytes"] == weights > 0
    closing = " ".join(out.split())  # the terminal wraps long lines
    assert "console: http://127.0.0.1:" in closing
    assert "/console (API key tml-demo-console-" in closing
    assert f"({weights / 1e6:.1f} MB of weights) for all 3 tenants" in closing
    assert "cycles: together" in closing and "one after another" in closing
    assert ("sharing saved" in closing) != ("no time saved here" in closing)
    assert "packing cost" not in closing
    for text in ("summary", "greedy samples", "what sharing gave on this machine"):
        assert text in closing
    # The server's own output went to the log, not over the live view.
    assert "Uvicorn running" in server_log.read_text() and "Uvicorn" not in out


def test_demo_vision_adds_a_tenant_that_names_an_images_colour(tmp_path: Path) -> None:
    """`lockstep demo --vision` serves the tiny Qwen3-VL model and trains the colour tenant beside
    a text tenant (few steps here: its loss falls; the README's default run names both colours)."""
    summary_path = tmp_path / "summary.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, "-m", "lockstep.cli", "demo", "--data-dir", str(tmp_path / "data")]
    argv += ["--port", str(free_port()), "--vision", "--tenants", "2", "--steps", "3"]
    argv += ["--summary-json", str(summary_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    server_log = tmp_path / "data" / "demo-serve.log"
    assert proc.returncode == 0, proc.stdout + proc.stderr + server_log.read_text()[-5000:]
    tenants = {t["name"]: t for t in json.loads(summary_path.read_text())["tenants"]}
    assert list(tenants) == ["colours", "rl"]
    colours = tenants["colours"]
    assert colours["last"] < colours["first"]
    assert "[new red image] -> " in colours["greedy"]
    assert "[new blue image] -> " in colours["greedy"]
    assert "greedy samples" in proc.stdout
