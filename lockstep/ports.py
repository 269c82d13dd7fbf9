"""Free TCP ports for the processes Lockstep starts (the supervisor's children, managed
vLLM/SGLang servers, test servers). A leaf module, so any package may import it."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now on `host` (the OS picks it; a race with other binders is possible)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
