"""gRPC options of the gateway -> scheduler link, both ends from one keepalive policy.

The gateway's channel pings the scheduler even while no call is in flight (so a dead scheduler or
a dropped NAT mapping is noticed before the next request rather than by it). A gRPC server with
default settings counts each such ping as abuse (it allows a ping without calls at most every
5 minutes) and, after two strikes, answers GOAWAY ENHANCE_YOUR_CALM "too_many_pings" and drops the
connection, failing whatever call was in flight at that moment. So the server must be told the
client's policy: `server_options` permits pings without calls at twice the client's rate.

The channel also retries a failed connection at most half a second apart. gRPC's default backoff
grows from 1 s by 1.6x up to 2 minutes, so a gateway that started before its scheduler listened
(every `lockstep serve`: the scheduler loads the engines first) or that lost a restarted scheduler
kept answering 503 for seconds, up to minutes, after the scheduler was back.
"""

from __future__ import annotations

from dataclasses import dataclass

Options = list[tuple[str, int]]


@dataclass(frozen=True)
class KeepalivePolicy:
    ping_every_ms: int = 30_000  # the client pings this often, calls or no calls
    ping_timeout_ms: int = 10_000  # no ack within this: the client closes and reconnects

    @property
    def server_min_ping_interval_ms(self) -> int:
        """The shortest gap between pings the server accepts: half the client's interval, so
        timer jitter never makes a ping look early."""
        return self.ping_every_ms // 2


KEEPALIVE = KeepalivePolicy()
# Reconnecting to a local scheduler is cheap; being cut off from it for long is not.
RECONNECT_FIRST_MS = 100
RECONNECT_MAX_MS = 500


def _message_limits(max_message_bytes: int) -> Options:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel_options(max_message_bytes: int, policy: KeepalivePolicy = KEEPALIVE) -> Options:
    """The gateway's channel to the scheduler."""
    return [
        *_message_limits(max_message_bytes),
        ("grpc.keepalive_time_ms", policy.ping_every_ms),
        ("grpc.keepalive_timeout_ms", policy.ping_timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # no cap on pings between data frames
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_FIRST_MS),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS),
    ]


def server_options(max_message_bytes: int, policy: KeepalivePolicy = KEEPALIVE) -> Options:
    """The scheduler's server: accepts the channel's pings, with or without calls in flight."""
    return [
        *_message_limits(max_message_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        # gRPC core's GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS (despite its name,
        # this key sets the server's receive side; the default is 5 minutes)
        ("grpc.http2.min_ping_interval_without_data_ms", policy.server_min_ping_interval_ms),
    ]
