"""Sliding-window attention on the Megatron engine (megatron-core's `window_size`, switched per
layer by `window_attn_skip_freq`) gives the local engine's numbers (fp32), on rows longer than
the window (the workload's rows have 5-29 tokens).

- Mistral (a window of 16 on every layer) at TP=2; the local engine runs it on its generic
  path, through the model's own sliding-window masks.
- Qwen2 with a window of 8 on its first layer and full attention on its second (gpt-oss-style
  `layer_types`) at PP=2: each stage holds one layer, so the second stage must pick its layer's
  kind by global layer number; the local engine runs it on its packed path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lockstep.modeling import zoo
from lockstep.workers.local.trainer import LocalTrainingEngine
from lockstep.workers.megatron.model import HFArch
from lockstep.workers.megatron.parallel import ParallelConfig
from lockstep.workers.megatron.trainer import MegatronTrainingEngine
from tests.megatron.common import assert_records_close, run_workload

CACHE = Path.home() / ".cache" / "lockstep-test-models"
ALTERNATING = {
    **zoo.FAMILIES["qwen2"],
    "use_sliding_window": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
}


def _model(name: str) -> Path:
    if name == "mistral":
        return zoo.ensure_family("mistral", CACHE)
    return zoo.ensure_model("tiny-qwen2-alternating-windows", ALTERNATING, CACHE)


@pytest.mark.parametrize(
    ("name", "parallel", "window", "windowed"),
    [
        pytest.param("mistral", ParallelConfig(tp=2), 16, (True, True), id="mistral-tp2"),
        pytest.param("alternating", ParallelConfig(pp=2), 8, (True, False), id="alternating-pp2"),
    ],
)
def test_sliding_windows_match_local_engine(
    name: str, parallel: ParallelConfig, window: int, windowed: tuple[bool, ...], tmp_path: Path
) -> None:
    model_dir = _model(name)
    arch = HFArch.from_dir(model_dir)
    assert (arch.window, arch.windowed) == (window, windowed)
    want = run_workload(LocalTrainingEngine(model_dir, "tiny", device="cpu"), tmp_path / "local")
    engine = MegatronTrainingEngine(model_dir, "tiny", parallel, launcher="process")
    try:
        got = run_workload(engine, tmp_path / "megatron")
    finally:
        engine.close()
    worst = assert_records_close(got, want)
    print(f"{name}: worst abs difference {worst:.3g} over {len(want)} values")
