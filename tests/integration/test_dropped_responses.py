"""Responses lost between the gateway and the client make the SDK retry, and every step is still
applied exactly once.

A small HTTP proxy (asyncio streams + h11) sits between the real tinker SDK and a real
`lockstep serve`. For chosen requests it forwards the request, lets the server answer, then
closes the client's connection instead of passing the answer on: the server did the work, the
SDK saw a dropped connection and retries. Drops hit forward_backward, optim_step and
retrieve_future. The adapter trained through the proxy must equal one trained directly, and the
server must have run exactly N optimizer steps for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator

import h11
import numpy as np
import pytest
import tinker
from tinker import types

from lockstep.demo import quickstart_data

from .conftest import Server
from .test_crash import adapter

pytestmark = pytest.mark.e2e
STEPS = 12
KEYS = {"direct": "tml-dropped-reference", "proxied": "tml-dropped-responses"}
# Which responses to drop: every 3rd forward_backward and optim_step submission, every 4th poll.
EVERY = {"/api/v1/forward_backward": 3, "/api/v1/optim_step": 3, "/api/v1/retrieve_future": 4}


class DroppingProxy:
    """HTTP/1.1 proxy in a background thread; one upstream connection per request."""

    def __init__(self, upstream: str, drop: Callable[[str], bool]) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.drop = drop
        self.seen: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._client, "127.0.0.1", 0)
        )
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        ready.set()
        self.loop.run_forever()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await self._read_request(reader)
            if request is None:
                return
            head, body = request
            path = head.target.decode().split("?")[0]
            response = await self._forward(head, body)
            self.seen[path] += 1
            if self.drop(path):
                self.dropped[path] += 1
                writer.transport.abort()  # the server did the work; the client never hears
                return
            writer.write(response)
            await writer.drain()
        finally:
            writer.close()

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[h11.Request, bytes] | None:
        conn = h11.Connection(h11.SERVER)
        head: h11.Request | None = None
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await reader.read(65536)
                if not data:
                    return None
                conn.receive_data(data)
            elif isinstance(event, h11.Request):
                head = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                assert head is not None
                return head, body
            else:
                return None

    async def _forward(self, head: h11.Request, body: bytes) -> bytes:
        """Send the request upstream with `Connection: close`; the raw answer, read to EOF
        (it carries `connection: close` too, so the client opens a new connection next)."""
        reader, writer = await asyncio.open_connection(*self.upstream)
        conn = h11.Connection(h11.CLIENT)
        headers = [(k, v) for k, v in head.headers if k.lower() != b"connection"]
        writer.write(
            conn.send(
                h11.Request(
                    method=head.method,
                    target=head.target,
                    headers=[*headers, (b"connection", b"close")],
                )
            )
        )
        writer.write(conn.send(h11.Data(data=body)) or b"")
        writer.write(conn.send(h11.EndOfMessage()) or b"")
        await writer.drain()
        raw = await reader.read()
        writer.close()
        return raw


def train(base_url: str, key: str) -> str:
    """STEPS pipelined steps (submit step k, then wait for step k-1); the final adapter's path."""
    client = tinker.ServiceClient(base_url=base_url, api_key=key)
    trainer = client.create_lora_training_client(
        base_model="Lockstep/tiny-qwen3", rank=4, seed=5
    ).result()
    data = quickstart_data(trainer.get_tokenizer())
    prev = None
    for step in range(STEPS):
        batch = [data[(2 * step + j) % len(data)] for j in range(2)]
        futures = (
            trainer.forward_backward(batch, "cross_entropy"),
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)),
        )
        if prev is not None:
            assert prev[0].result().metrics["loss:sum"] > 0
            prev[1].result()
        prev = futures
    assert prev is not None
    prev[0].result()
    prev[1].result()
    return str(trainer.save_weights_for_sampler("final").result().path)


def optim_steps_run(server: Server, key: str) -> float:
    """`lockstep_tenant_requests_total{kind="optim_step", outcome="ok"}` of the key's owner."""
    port = re.findall(r"metrics: http://\S+ \(gateway\), http://[^:]+:(\d+)/metrics", server.log())
    assert port, "lockstep serve logs the scheduler's metrics address"
    text = urllib.request.urlopen(f"http://127.0.0.1:{port[-1]}/metrics", timeout=10).read()
    owner = hashlib.sha256(key.encode()).hexdigest()[:16]
    total = 0.0
    for line in text.decode().splitlines():
        if (
            line.startswith("lockstep_tenant_requests_total{")
            and f'owner="{owner}"' in line
            and 'kind="optim_step"' in line
            and 'outcome="ok"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture()
def proxy(server: Server) -> Iterator[DroppingProxy]:
    counts: Counter[str] = Counter()

    def drop(path: str) -> bool:
        counts[path] += 1
        every = EVERY.get(path)
        return every is not None and counts[path] % every == 0

    p = DroppingProxy(server.base_url, drop)
    yield p
    p.close()


def test_dropped_responses_apply_every_step_exactly_once(
    server: Server, proxy: DroppingProxy
) -> None:
    reference = adapter(server, train(server.base_url, KEYS["direct"]))
    survived = adapter(server, train(proxy.url, KEYS["proxied"]))

    for path in EVERY:
        assert proxy.dropped[path] > 0, (path, proxy.seen, proxy.dropped)
    assert reference.keys() == survived.keys()
    for name in reference:
        np.testing.assert_allclose(survived[name], reference[name], atol=1e-5, err_msg=name)
    assert optim_steps_run(server, KEYS["proxied"]) == STEPS
    assert optim_steps_run(server, KEYS["direct"]) == STEPS
