"""The real scheduler in-process, for tests that drive it cycle by cycle: the gRPC service,
Submissions, Redis store, planner, clock, dispatcher and sampling lane of `lockstep serve`, wired
by the same `assemble`, on a real Redis, with the deterministic FAKE engines of
`arithmetic_engine`. The clock does not run by itself: `tick()` runs one cycle.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from lockstep.config import ClockConfig, EngineConfig
from lockstep.config.training import DEFAULT_SNAPSHOT_INTERVAL_S as DEFAULT_SNAPSHOT_S
from lockstep.engine.interface import SamplingEngine, TrainingEngine
from lockstep.scheduler.server import SchedulerConfig, assemble
from lockstep.scheduler.state.store import Store
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc
from lockstep.wire.v1 import tinker_pb2 as wire

from .arithmetic_engine import ArithmeticSamplingEngine, ArithmeticTrainingEngine

OWNER = "tml-in-process"


class Scheduler:
    """The real scheduler on its own event loop thread, served over gRPC on loopback."""

    def __init__(
        self,
        redis_url: str,
        data_dir: Path,
        snapshot_interval_s: float = DEFAULT_SNAPSHOT_S,
        trainer: TrainingEngine | None = None,
        sampler: SamplingEngine | None = None,
    ) -> None:
        """`trainer`: a real training engine instead of the fake (its card names the model);
        `sampler`: a real sampling engine instead of the fake."""
        self.trainer: Any = trainer or ArithmeticTrainingEngine(data_dir)
        self.sampler: Any = sampler or ArithmeticSamplingEngine(data_dir)
        self.data_dir = data_dir
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        cfg = SchedulerConfig(
            listen="127.0.0.1:0",
            redis_url=redis_url,
            data_dir=data_dir,
            model_dir=Path(self.trainer.card().directory) if trainer else data_dir,
            served_names=(self.trainer.card().name,),
            clock=ClockConfig(gather_s=0.002),
            engine=EngineConfig(snapshot_interval_s=snapshot_interval_s),
        )
        port = self.run(self._start(cfg))
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.SchedulerStub(self.channel)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    async def _start(self, cfg: SchedulerConfig) -> int:
        self.store = Store.from_url(cfg.redis_url)
        parts = assemble(cfg, self.store, self.trainer, self.sampler)
        self.clock, self.lane = parts.clock, parts.lane

        async def health() -> dict[str, str]:
            return {}

        self.server = grpc.aio.server()
        pb_grpc.add_SchedulerServicer_to_server(parts.service(health), self.server)
        port = self.server.add_insecure_port(cfg.listen)
        await self.server.start()
        # The clock does not run by itself: the test calls tick(). Samples flow on their lane.
        self.tasks = [asyncio.create_task(self.lane.run())]
        return port

    def tick(self) -> None:
        """Run one clock cycle (plan -> dispatch -> publish -> commit -> notify)."""
        self.run(self.clock.cycle())

    async def _stop(self) -> None:
        self.lane.stop()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.stop(grace=1)
        await self.store.close()

    def close(self) -> None:
        self.channel.close()
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def fb(model_id: str, seq: int, tokens: list[int], forward_only: bool = False) -> pb.SubmitRequest:
    req = wire.ForwardBackwardRequest(
        model_id=model_id, seq_id=seq, loss_fn="cross_entropy", forward_only=forward_only
    )
    d = req.data.add()
    inputs = np.asarray(tokens[:-1], "<i4").tobytes()
    d.model_input.append(wire.Chunk(encoded_text=wire.EncodedTextChunk(tokens=inputs)))
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        wire.Tensor(
            dtype=wire.DTYPE_INT64,
            shape=[len(tokens) - 1],
            dense=np.asarray(tokens[1:], "<i8").tobytes(),
        )
    )
    return pb.SubmitRequest(owner=OWNER, forward_backward=req)
