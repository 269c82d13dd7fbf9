"""The hosted catalog's architectures through the real SDK against a real `lockstep serve`.

One server per family (its tiny model from lockstep/modeling/zoo.py, in its published layout,
served under a hub-style name): two LoRA tenants of different ranks train in shared clock cycles
(packed), the loss falls, a sampler client samples greedily and its logprobs equal the trainer's,
and an MoE adapter is saved in Tinker's format (3-D expert tensors); a hybrid family reports
which implementation runs each of its hybrid kernels (`get_info`, capabilities, the metric). The
numbers themselves are checked per family in tests/unit/test_architectures.py; this is the
service path.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors import safe_open

from lockstep.devserver import Server, start_server, stop_server
from lockstep.modeling import zoo
from lockstep.ports import free_port

from .packing import assert_packed

pytestmark = pytest.mark.e2e
API_KEY = "tml-families-test"
FAMILIES = ["qwen3_5", "qwen3_5_moe", "gpt_oss", "deepseek_v3", "qwen3_moe", "nemotron_h", "llama"]
MOE = {"qwen3_5_moe", "gpt_oss", "deepseek_v3", "qwen3_moe", "nemotron_h"}
# The hybrid kernels each family's layers call (none: no hybrid layers).
HYBRID = {
    "qwen3_5": {"short_convolution", "gated_delta_rule"},
    "qwen3_5_moe": {"short_convolution", "gated_delta_rule"},
    "nemotron_h": {"short_convolution", "mamba2_scan"},
}
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 2


@pytest.fixture(scope="module", params=FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Server, int]]:
    family = request.param
    os.environ["HF_HUB_OFFLINE"] = "1"
    root = tmp_path_factory.mktemp(family)
    directory = zoo.ensure_family(family, root / "models")
    name = zoo.served_name(family)
    port = free_port()
    server = start_server(
        root / "data", "--model", f"{name}={directory}", "--metrics-port", str(port)
    )
    yield name, server, port
    code = stop_server(server)
    assert code == 0, f"lockstep serve did not stop cleanly ({code}):\n{server.log()[-5000:]}"


def test_family_trains_packed_and_samples_through_the_sdk(
    served: tuple[str, Server, int],
) -> None:
    import tinker
    from tinker import types

    name, server, _ = served
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    tenants = [
        service.create_lora_training_client(base_model=name, rank=rank, seed=i).result()
        for i, rank in enumerate((8, 16))
    ]
    ids = tenants[0].get_tokenizer().encode(TEXT)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    losses: list[list[float]] = []
    rounds: list[list[int]] = []
    for _ in range(4):  # pipelined: both tenants' steps submitted before any result is read
        passes = [t.forward_backward([datum], "cross_entropy") for t in tenants]
        steps = [t.optim_step(types.AdamParams(learning_rate=1e-2)) for t in tenants]
        results = [p.result() for p in passes]
        for s in steps:
            s.result()
        rounds.append([int(r.metrics["clock_cycle:unique"]) for r in results])
        losses.append([r.metrics["loss:sum"] for r in results])
    for tenant in range(2):
        assert losses[-1][tenant] < 0.9 * losses[0][tenant], losses

    sampler = tenants[0].save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(ids[:12])
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0)
    out = sampler.sample(prompt, 2, greedy).result()
    assert len(out.sequences) == 2 and out.sequences[0].tokens == out.sequences[1].tokens
    assert len(out.sequences[0].tokens) == 8
    sampled = np.array(sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()[1:])
    trained = np.array(
        tenants[0].forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    )
    np.testing.assert_allclose(sampled.astype(np.float64), trained, rtol=0, atol=1e-4)
    session = service.holder.get_session_id()
    assert_packed(server.base_url, API_KEY, session, rounds)  # the rounds' traces are written

    if name.removeprefix("Lockstep/tiny-").replace("-", "_") in MOE:
        files = list((Path(server.data_dir) / "checkpoints").rglob("adapter_model.safetensors"))
        assert len(files) == 1, files
        with safe_open(str(files[0]), "pt") as f:
            experts = {k: f.get_slice(k).get_shape() for k in f.keys() if ".experts.w" in k}
        assert experts, "an MoE adapter trains its experts"
        # Tinker's layout: 3-D per projection; gate-less experts (Nemotron) keep an empty w3.
        assert all(len(shape) == 3 or shape == [0] for shape in experts.values()), experts
        assert sum(len(shape) == 3 for shape in experts.values()) >= 4


def test_hybrid_kernels_are_reported(served: tuple[str, Server, int]) -> None:
    """Which implementation runs each hybrid kernel, in get_info, the server's capabilities and
    the scheduler's metric: on this CPU the PyTorch reference, in both engines."""
    import httpx
    import tinker

    name, server, port = served
    family = name.removeprefix("Lockstep/tiny-").replace("-", "_")
    want = dict.fromkeys(sorted(HYBRID.get(family, ())), "reference") or None
    service = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    trainer = service.create_lora_training_client(base_model=name, rank=4).result()
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": API_KEY}) as http:
        info = http.post("/api/v1/get_info", json={"model_id": trainer.model_id}).json()
        caps = http.get("/api/v1/get_server_capabilities").json()["supported_models"][0]
    assert info.get("trainer_kernels") == want
    assert caps.get("trainer_kernels") == want and caps.get("sampler_kernels") == want
    scraped = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    reported = {
        (s.labels["engine"], s.labels["kernel"], s.labels["implementation"])
        for family in text_string_to_metric_families(scraped)
        if family.name == "lockstep_hybrid_kernel"
        for s in family.samples
        if s.value == 1
    }
    assert reported == {(e, k, "reference") for e in ("trainer", "sampler") for k in want or ()}
