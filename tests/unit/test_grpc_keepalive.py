"""The gateway's channel and the scheduler's server agree on keepalive (lockstep.grpc_options).

A real grpc.aio server and channel on loopback, built from the same option lists the gateway and
the scheduler use, with the policy shrunk from 30 s pings to 1 s ones (gRPC's client sends no more
than one ping a second whatever it is asked, so 1 s is the floor). The servicer answers only
Health: what is under test is the HTTP/2 transport, not the scheduler's RPCs.

With the server on gRPC's defaults (what the scheduler had), the idle channel's third ping gets
GOAWAY ENHANCE_YOUR_CALM "too_many_pings" and the connection drops; gRPC core logs that on the
process's stderr, which capfd reads.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from lockstep import grpc_options
from lockstep.v1 import scheduler_pb2 as pb
from lockstep.v1 import scheduler_pb2_grpc as pb_grpc

POLICY = grpc_options.KeepalivePolicy(ping_every_ms=1000, ping_timeout_ms=5000)
MAX_MESSAGE = 1 << 20
# gRPC's default server policy strikes out on the third idle ping (~3 s at 1 ping/s): stay idle
# well past that.
IDLE_S = 8.0


class HealthOnly(pb_grpc.SchedulerServicer):
    async def Health(self, request, context):  # type: ignore[no-untyped-def]
        return pb.HealthReply(ready=True)


async def _idle_then_call(
    server_options: grpc_options.Options, capfd: pytest.CaptureFixture[str]
) -> tuple[list[grpc.ChannelConnectivity], list[str]]:
    """Connect, make a call, stay idle for IDLE_S (or until the connection drops), call again.
    Returns the channel's state changes during the idle time and gRPC's stderr lines that name
    this server's port, read before teardown: stopping the server sends its own GOAWAY
    ("Cancelling all calls"), which is not what is under test."""
    server = grpc.aio.server(options=server_options)
    pb_grpc.add_SchedulerServicer_to_server(HealthOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=grpc_options.channel_options(MAX_MESSAGE, POLICY)
    )
    try:
        capfd.readouterr()  # drop what earlier tests' channels logged
        stub = pb_grpc.SchedulerStub(channel)
        assert (await stub.Health(pb.Empty(), timeout=10)).ready
        state = channel.get_state()
        assert state == grpc.ChannelConnectivity.READY
        changes = []
        deadline = time.monotonic() + IDLE_S
        while time.monotonic() < deadline and not changes:
            try:
                await asyncio.wait_for(channel.wait_for_state_change(state), 0.2)
            except TimeoutError:
                continue
            state = channel.get_state()
            changes.append(state)
        ours = [line for line in capfd.readouterr().err.splitlines() if f":{port}" in line]
        assert (await stub.Health(pb.Empty(), timeout=10)).ready  # reconnects if it must
        return changes, ours
    finally:
        await channel.close()
        await server.stop(None)


def test_idle_channel_keeps_its_connection(capfd: pytest.CaptureFixture[str]) -> None:
    options = grpc_options.server_options(MAX_MESSAGE, POLICY)
    changes, ours = asyncio.run(_idle_then_call(options, capfd))
    log = "\n".join(ours)
    assert changes == [], f"the idle connection dropped: {changes}\n{log}"
    assert not any("goaway" in line.lower() for line in ours), log


def test_default_server_policy_drops_the_idle_channel(capfd: pytest.CaptureFixture[str]) -> None:
    """The failure the shared options fix, reproduced: a server with gRPC's defaults."""
    defaults = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
    ]
    changes, ours = asyncio.run(_idle_then_call(defaults, capfd))
    log = "\n".join(ours)
    assert changes and changes[0] != grpc.ChannelConnectivity.READY, changes
    assert any("too_many_pings" in line for line in ours), log
