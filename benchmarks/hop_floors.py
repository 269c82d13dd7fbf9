"""What each hop of the request path costs at its barest on this machine: the floor under
control_plane.py's numbers.

  http   a POST of a small JSON body to an ASGI app that only answers `{}`, served as the
         gateway is served (uvicorn, uvloop, httptools), from an httpx client as the SDK's
  grpc   a unary call of a few bytes to a grpc.aio server that only echoes them, over a Unix
         socket, both ends on uvloop, as gateway -> scheduler
  redis  a PING from redis-py's asyncio client, as the scheduler's round trips

Each is timed one call at a time with a short idle gap, as single requests travel; the servers
run in their own processes.

    python benchmarks/hop_floors.py [--n 300]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import uvloop

from lockstep.ports import free_port

GAP_S = 0.002  # idle between calls, as between single requests

_HTTP_APP = """
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    await receive()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})
"""

_GRPC_SERVER = """
import sys, grpc, uvloop

async def serve(path):
    server = grpc.aio.server()
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("floor", {"Echo": echo})])
    server.add_insecure_port("unix:" + path)
    await server.start()
    await server.wait_for_termination()

uvloop.run(serve(sys.argv[1]))
"""


def _ms(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1000,
    }


def _timed_sync(call: Callable[[], object], n: int) -> list[float]:
    for _ in range(20):
        call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
        time.sleep(GAP_S)
    return out


async def _timed_async(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    for _ in range(20):
        await call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        out.append(time.perf_counter() - start)
        await asyncio.sleep(GAP_S)
    return out


def _started(cmd: list[str], ready: Callable[[], bool]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{cmd[:3]} did not start")
        time.sleep(0.1)
    return proc


def http_floor(n: int, tmp: Path) -> dict[str, float]:
    (tmp / "floor_app.py").write_text(_HTTP_APP)
    port = free_port()
    serve = (
        f"import sys, uvicorn; sys.path.insert(0, {str(tmp)!r}); uvicorn.run('floor_app:app', "
        f"port={port}, loop='uvloop', http='httptools', log_level='warning', access_log=False)"
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10)

    def up() -> bool:
        try:
            return client.post("/x", json={}).status_code == 200
        except httpx.TransportError:
            return False

    proc = _started([sys.executable, "-c", serve], up)
    try:
        return _ms(_timed_sync(lambda: client.post("/x", json={"request_id": "r"}), n))
    finally:
        client.close()
        proc.terminate()
        proc.wait()


def grpc_floor(n: int, tmp: Path) -> dict[str, float]:
    import grpc

    path = str(tmp / "floor.sock")
    proc = _started([sys.executable, "-c", _GRPC_SERVER, path], lambda: Path(path).exists())

    async def run() -> list[float]:
        async with grpc.aio.insecure_channel("unix:" + path) as channel:
            echo = channel.unary_unary("/floor/Echo")
            await channel.channel_ready()
            return await _timed_async(lambda: echo(b"x" * 64), n)

    try:
        return _ms(uvloop.run(run()))
    finally:
        proc.terminate()
        proc.wait()


def redis_floor(n: int, url: str) -> dict[str, float]:
    import redis.asyncio as aioredis

    async def run() -> list[float]:
        client = aioredis.Redis.from_url(url)
        try:
            return await _timed_async(client.ping, n)
        finally:
            await client.aclose()

    return _ms(uvloop.run(run()))


def floors(n: int, redis_url: str) -> dict[str, Any]:
    """Each hop's bare round trip (ms); `redis_url`: a running Redis."""
    with tempfile.TemporaryDirectory() as tmp:
        return {
            "http": http_floor(n, Path(tmp)),
            "grpc": grpc_floor(n, Path(tmp)),
            "redis": redis_floor(n, redis_url),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--redis-url", required=True, help="a running Redis, e.g. redis://127.0.0.1")
    args = p.parse_args()
    print(json.dumps(floors(args.n, args.redis_url), indent=2))


if __name__ == "__main__":
    main()
