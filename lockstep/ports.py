"""Free TCP ports for the processes Lockstep starts (the supervisor's children, managed
vLLM/SGLang servers, test servers). A leaf module, so any package may import it.

A port is picked outside the OS's ephemeral range. Every outgoing connection takes its source
port from that range, so a port the OS hands out there (`bind(0)`) can be taken by any client
connection between the check and the child's own bind; on a busy machine that happens
(`lockstep serve` failing with Errno 98 while other servers' clients were connecting).
"""

from __future__ import annotations

import random
import socket
from collections import deque
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux
IANA_EPHEMERAL = (49152, 65535)  # elsewhere (macOS, Windows)
LOWEST = 10000  # below: ports people configure services on
TRIES = 200
_given: deque[int] = deque(maxlen=256)  # this process's recent answers: never the same twice
_pick = random.SystemRandom()  # not the `random` a test may have seeded alike in two processes


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = EPHEMERAL_RANGE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return IANA_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` and outside the ephemeral range (module docstring); a
    race with another listener choosing the same port is still possible, but rare."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((LOWEST, low - 1), (high + 1, 65535)) if a <= b]
    for _ in range(TRIES):
        a, b = _pick.choices(spans, weights=[b - a + 1 for a, b in spans])[0]
        port = _pick.randint(a, b)
        if port in _given or not _bindable(host, port):
            continue
        _given.append(port)
        return port
    raise OSError(f"no free port on {host} outside the ephemeral range {low}-{high}")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
