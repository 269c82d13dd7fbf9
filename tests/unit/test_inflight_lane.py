"""Inflight targets in the store and the sampling lane (real Redis, real local sampler): versions
only move forward, a client never runs on weights older than its save, an older client adopts a
newer version once it is loaded, and superseded versions leave the engine."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lockstep.engine.types import LoraSpec
from lockstep.modeling.loader import load_base_model
from lockstep.modeling.lora import LoraModel
from lockstep.modeling.peft_io import save_peft_adapter
from lockstep.modeling.tiny import DEFAULT_MODEL_NAME, ensure_default_model
from lockstep.rollout.local import LocalSamplingEngine
from lockstep.scheduler.cycle.sampling_lane import SamplingLane
from lockstep.scheduler.state.futures import FutureBoard
from lockstep.scheduler.state.records import InflightTarget, SamplerRecord
from lockstep.scheduler.state.store import Store

MODEL = "sess-1:train:0"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSamplingEngine, list]]:
    """The local sampler and three versions of one adapter (v1, v2, v3)."""
    model_dir = ensure_default_model(tmp_path_factory.mktemp("models"))
    lora = LoraModel(load_base_model(model_dir, DEFAULT_MODEL_NAME, "cpu")[0])
    spec = LoraSpec(rank=4, alpha=8.0, seed=1)
    lora.add_adapter("x", spec)
    root = tmp_path_factory.mktemp("versions")
    dirs = []
    for v in range(1, 4):
        gen = torch.Generator().manual_seed(v)
        state = {
            k: (torch.randn(t.shape, generator=gen) * 0.5 if ".lora_B." in k else t)
            for k, t in lora.adapter_state("x").items()
        }
        save_peft_adapter(root / f"v{v}", state, spec, DEFAULT_MODEL_NAME)
        dirs.append(root / f"v{v}")
    engine = LocalSamplingEngine(model_dir, DEFAULT_MODEL_NAME)
    yield engine, dirs
    engine.close()


def target(version: int, dirs: list[Path]) -> InflightTarget:
    return InflightTarget(MODEL, version, f"{MODEL}:v{version}", str(dirs[version - 1]))


def client(version: int, dirs: list[Path]) -> SamplerRecord:
    t = target(version, dirs)
    return SamplerRecord(
        sampler_id=f"client-{version}",
        owner="o",
        session_id="sess-1",
        base_model="m",
        adapter_dir=t.adapter_dir,
        adapter_id=t.adapter_id,
        inflight_model=MODEL,
        min_version=version,
    )


def test_target_versions_only_move_forward(clean_redis: str, tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]

    async def go() -> None:
        store = Store.from_url(clean_redis)
        assert await store.checkpoints.advance_inflight(target(2, dirs))
        assert not await store.checkpoints.advance_inflight(target(1, dirs))  # older: refused
        assert not await store.checkpoints.advance_inflight(target(2, dirs))  # same: no-op
        current = await store.checkpoints.inflight(MODEL)
        assert current is not None and current.version == 2
        assert await store.checkpoints.advance_inflight(target(3, dirs))
        current = await store.checkpoints.inflight(MODEL)
        assert current is not None and current.version == 3
        await store.close()

    asyncio.run(go())


def test_lane_serves_inflight_clients_never_older_than_their_save(
    clean_redis: str, setup: tuple[LocalSamplingEngine, list[Path]]
) -> None:
    engine, dirs = setup

    async def go() -> None:
        store = Store.from_url(clean_redis)
        lane = SamplingLane(store, engine, FutureBoard(store))
        a, b = client(1, dirs), client(2, dirs)
        await store.checkpoints.advance_inflight(target(1, dirs))
        assert await lane._inflight_adapter(a) == target(1, dirs).adapter_id

        # W2 published; nothing loaded it yet. B (created at v2) must wait for it; A may not
        # see v1 once B's sample has loaded v2 (within one publish).
        await store.checkpoints.advance_inflight(target(2, dirs))
        assert await lane._inflight_adapter(b) == target(2, dirs).adapter_id
        assert await lane._inflight_adapter(a) == target(2, dirs).adapter_id

        # A stale publish (v1 again) changes nothing: versions only move forward.
        lane.publish([], [target(1, dirs)])
        await asyncio.sleep(0)
        assert await lane._inflight_adapter(a) == target(2, dirs).adapter_id

        # W3 published by the clock: the old client keeps the loaded v2 until v3 is in, then
        # switches; v1 and v2 are unloaded between batches.
        await store.checkpoints.advance_inflight(target(3, dirs))
        lane.publish([], [target(3, dirs)])
        for task in list(lane._loading.values()):
            await task
        assert await lane._inflight_adapter(a) == target(3, dirs).adapter_id
        await lane.serve_once()  # frees superseded versions before the next batch
        resident = engine.resident_adapters()
        assert target(3, dirs).adapter_id in resident
        assert target(1, dirs).adapter_id not in resident
        assert target(2, dirs).adapter_id not in resident
        await store.close()

    asyncio.run(go())


def test_a_client_waits_for_its_version_when_an_older_one_is_served(
    clean_redis: str, setup: tuple[LocalSamplingEngine, list[Path]]
) -> None:
    """The loaded v1 is not good enough for a client saved at v2, even before any publish."""
    engine, dirs = setup

    async def go() -> None:
        store = Store.from_url(clean_redis)
        lane = SamplingLane(store, engine, FutureBoard(store))
        await store.checkpoints.advance_inflight(target(1, dirs))
        assert await lane._inflight_adapter(client(1, dirs)) == target(1, dirs).adapter_id
        # v2's record reached the client, but the lane has heard of no publish yet.
        await store.checkpoints.advance_inflight(target(2, dirs))
        assert await lane._inflight_adapter(client(2, dirs)) == target(2, dirs).adapter_id
        await store.close()

    asyncio.run(go())
