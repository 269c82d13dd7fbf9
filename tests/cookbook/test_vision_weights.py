"""Adapters of every vision-language family read by tinker-cookbook's own weights tools.

Per family (tiny random VLMs in the published ForConditionalGeneration layout): a tenant trains
a few SFT steps with images on the local engine and exports its adapter (the text family's
adapter names: no `model.language_model.` prefix, no tower keys). The cookbook venv's unmodified
`weights.build_hf_model` merges it into the published checkpoint (adding the prefix itself), and
that model's own forward, with the image processor's pixels, gives the trainer's logprobs
(<= 1e-4) at every position; they moved from the base model's. One driver process serves every
family.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from lockstep.engine.images import ImageLimits, ImageReader
from lockstep.engine.types import AdamConfig, Datum, LoraSpec, OptimRequest, PassRequest
from lockstep.modeling.vision import zoo as vision_zoo
from lockstep.workers.local.trainer import LocalTrainingEngine

from .conftest import DRIVERS, offline_env

pytestmark = [pytest.mark.cookbook]


def _png(path: Path, rgb: tuple[int, int, int], size: tuple[int, int]) -> bytes:
    pixels = np.clip(
        np.asarray(rgb) + np.random.default_rng(sum(rgb)).integers(-20, 20, (*size[::-1], 3)),
        0,
        255,
    )
    out = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(out, format="PNG")
    path.write_bytes(out.getvalue())
    return out.getvalue()


def _datum(engine: LocalTrainingEngine, pictures: list[bytes]) -> Datum:
    spec = engine.card().vision
    assert spec is not None
    reader = ImageReader(spec, ImageLimits(1 << 24, 1 << 24))
    ids = [5, 6, 7]
    found = []
    for picture in pictures:
        found.append(reader.image("c", picture, "png", None, len(ids)))
        ids += [spec.image_token_id] * found[-1].tokens + [8, 9]
    ids += [10, 11, 12]
    targets = np.asarray(ids[1:] + [13])
    return Datum(
        np.asarray(ids),
        {"target_tokens": targets, "weights": np.ones(len(ids), "f4")},
        tuple(found),
    )


def test_cookbook_merges_vision_adapters_with_the_trainers_logprobs(
    cookbook_python: Path, tmp_path: Path
) -> None:
    jobs, expected, base = [], {}, {}
    for family in sorted(vision_zoo.FAMILIES):
        directory = vision_zoo.ensure_family(family, tmp_path / "models")
        engine = LocalTrainingEngine(directory, family, device="cpu")
        files = [tmp_path / f"{family}-{k}.png" for k in range(2)]
        pictures = [
            _png(files[0], (200, 30, 30), (64, 48)),
            _png(files[1], (30, 30, 200), (96, 64)),
        ]
        datum = _datum(engine, pictures)
        engine.create_model("t", LoraSpec(rank=4, seed=1))
        base[family] = engine.run_passes(
            [PassRequest("b", "t", "cross_entropy", {}, True, [datum])]
        )[0].outputs[0]["logprobs"]
        for _ in range(3):
            engine.run_passes([PassRequest("s", "t", "cross_entropy", {}, False, [datum])])
            engine.optim_step([OptimRequest("t", AdamConfig(learning_rate=1e-2))])
        expected[family] = engine.run_passes(
            [PassRequest("f", "t", "cross_entropy", {}, True, [datum])]
        )[0].outputs[0]["logprobs"]
        adapter = tmp_path / family / "adapter"
        engine.export_adapter("t", adapter)
        row = {
            "ids": datum.tokens.tolist(),
            "targets": datum.loss_inputs["target_tokens"].tolist(),
            "images": [str(f) for f in files],
        }
        jobs.append(
            {
                "base_model": str(directory),
                "adapter_path": str(adapter),
                "out_dir": str(tmp_path / family),
                "rows": [row],
            }
        )
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.run(
        [str(cookbook_python), str(DRIVERS / "vision_weights.py"), json.dumps({"jobs": jobs})],
        capture_output=True,
        text=True,
        env=offline_env(home),
        cwd=home,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for family in sorted(vision_zoo.FAMILIES):
        (merged,) = json.loads((tmp_path / family / "logprobs.json").read_text())
        assert np.abs(np.asarray(merged) - expected[family]).max() <= 1e-4, family
        assert np.abs(expected[family] - base[family]).max() > 1e-3, (
            family
        )  # the adapter moved them
