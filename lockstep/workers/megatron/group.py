"""Worker groups: one `RankWorker` per rank, called all at once with the same arguments.

- `RayWorkerGroup`: one Ray actor per rank inside one placement group (the deployment path);
  rank 0's node address is every rank's MASTER_ADDR.
- `ProcessWorkerGroup`: one spawned local process per rank over pipes (no Ray), used by the
  equality tests and the benchmark (`launcher="process"`; no CLI flag).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import traceback
from multiprocessing.connection import Connection
from typing import Any, Protocol

from lockstep.engine.interface import EngineDied
from lockstep.ports import free_port
from lockstep.workers.megatron.parallel import ParallelConfig

log = logging.getLogger("lockstep.megatron")


class WorkerGroup(Protocol):
    def call(self, method: str, *args: Any) -> list[Any]:
        """Run `RankWorker.<method>(*args)` on every rank; results in rank order."""

    def close(self) -> None: ...


# -- local processes ----------------------------------------------------------------------


def _serve_rank(
    conn: Connection,
    model_dir: str,
    parallel: ParallelConfig,
    rank: int,
    addr: str,
    port: int,
    micro_batch: int,
) -> None:
    import torch

    from lockstep.workers.megatron.rank_worker import RankWorker

    # The ranks share the machine's cores (OMP_NUM_THREADS, when set, decides).
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(
        int(threads) if threads else max(1, (os.cpu_count() or 1) // parallel.world_size)
    )
    try:
        worker = RankWorker(model_dir, parallel, rank, addr, port, micro_batch)
        conn.send(("ok", None))
    except BaseException as exc:  # report, then exit: the group cannot start
        conn.send(("err", (exc, traceback.format_exc())))
        return
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            break
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except BaseException as exc:
            conn.send(("err", (exc, traceback.format_exc())))
        if method == "close":
            break


class ProcessWorkerGroup:
    def __init__(self, model_dir: str, parallel: ParallelConfig, micro_batch: int = 8) -> None:
        ctx = mp.get_context("spawn")
        port = free_port("")
        self._conns: list[Connection] = []
        self._procs = []
        for rank in range(parallel.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve_rank,
                daemon=True,
                name=f"megatron-rank{rank}",
                args=(child, model_dir, parallel, rank, "127.0.0.1", port, micro_batch),
            )
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect()

    def _collect(self) -> list[Any]:
        results, error = [], None
        for rank, conn in enumerate(self._conns):
            try:
                status, value = conn.recv()
            except EOFError:
                # EngineDied: the scheduler restarts the trainer (a fresh group) and re-runs.
                status, value = "err", (EngineDied(f"megatron rank {rank} died"), "")
            if status == "err" and error is None:
                error = value
            results.append(value if status == "ok" else None)
        if error is not None:
            exc, tb = error
            log.error("megatron rank failed:\n%s", tb)
            raise exc
        return results

    def call(self, method: str, *args: Any) -> list[Any]:
        for conn in self._conns:
            conn.send((method, args))
        return self._collect()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        try:
            if self.alive():
                self.call("close")
        finally:
            for p in self._procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()


# -- Ray ----------------------------------------------------------------------------------


class _RankActor:
    """The Ray actor body: builds its RankWorker once the group knows rank 0's address."""

    def __init__(self) -> None:
        self.worker: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), free_port("")

    def setup(
        self,
        model_dir: str,
        parallel: ParallelConfig,
        rank: int,
        addr: str,
        port: int,
        micro_batch: int,
    ) -> None:
        from lockstep.workers.megatron.rank_worker import RankWorker

        self.worker = RankWorker(model_dir, parallel, rank, addr, port, micro_batch)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayWorkerGroup:
    def __init__(
        self,
        model_dir: str,
        parallel: ParallelConfig,
        micro_batch: int = 8,
        address: str | None = None,
        cpus_per_rank: float = 0.5,
        gpus_per_rank: float = 0.0,
        placement: str = "PACK",
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            if address:
                ray.init(address=address, log_to_driver=True)
            else:  # a local runtime sized for the group
                cpus = max(1, int(parallel.world_size * cpus_per_rank + 0.999))
                ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
        bundle: dict[str, float] = {"CPU": cpus_per_rank}
        if gpus_per_rank:
            bundle["GPU"] = gpus_per_rank
        self._pg = placement_group([bundle] * parallel.world_size, strategy=placement)
        ray.get(self._pg.ready(), timeout=120)
        actor_cls = ray.remote(_RankActor)
        self._actors: list[Any] = [
            actor_cls.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
            ).remote()
            for rank in range(parallel.world_size)
        ]
        addr, port = ray.get(self._actors[0].address.remote())
        ray.get(
            [
                a.setup.remote(model_dir, parallel, rank, addr, port, micro_batch)
                for rank, a in enumerate(self._actors)
            ]
        )

    def call(self, method: str, *args: Any) -> list[Any]:
        refs = [self._ray.put(a) for a in args]  # one copy in the object store for all ranks
        try:
            return list(self._ray.get([a.call.remote(method, *refs) for a in self._actors]))
        except self._ray.exceptions.RayActorError as exc:
            # A lost rank loses the group's state: the scheduler restarts the trainer process
            # (a fresh group) and re-runs the cycle from the last snapshots.
            raise EngineDied(f"a megatron rank died: {exc}") from exc

    def alive(self) -> bool:
        return True

    def close(self) -> None:
        ray = self._ray
        try:
            ray.get([a.call.remote("close") for a in self._actors], timeout=30)
        except Exception:  # the group is going away either way
            log.warning("megatron ranks did not close cleanly", exc_info=True)
        for a in self._actors:
            ray.kill(a)
        ray.util.remove_placement_group(self._pg)
        if self._owns_ray:  # the local runtime we started goes with the group
            ray.shutdown()
