"""lockstep.ports: ports for the processes Lockstep starts come from outside the OS's ephemeral
range (a client connection can take a port from inside it between the check and the bind)."""

from __future__ import annotations

import socket

from lockstep import ports


def test_free_ports_are_outside_the_ephemeral_range_bindable_and_not_repeated() -> None:
    low, high = ports.ephemeral_range()
    given = [ports.free_port() for _ in range(200)]
    assert len(set(given)) == len(given)
    for port in given:
        assert ports.LOWEST <= port <= 65535 and not low <= port <= high, (port, low, high)
    with socket.socket() as s:
        s.bind(("127.0.0.1", given[-1]))  # free when given (nothing here took it since)


def test_a_port_someone_listens_on_is_not_bindable() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen()
        assert not ports._bindable("127.0.0.1", held.getsockname()[1])


def test_the_ephemeral_range_is_read_from_the_os_or_assumed() -> None:
    low, high = ports.ephemeral_range()
    assert 1024 <= low <= high <= 65535
