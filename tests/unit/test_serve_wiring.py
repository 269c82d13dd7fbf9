"""How `lockstep serve` wires its gateway to its scheduler (lockstep/supervisor.py): a Unix
socket in the data dir by default, loopback TCP when asked, and TCP when the socket's path would
not fit the system's limit. The written config is what both children read."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lockstep import config
from lockstep.cli import build_parser
from lockstep.config import LockstepConfig
from lockstep.supervisor import MAX_UNIX_SOCKET_PATH, Supervisor


def _wired(data_dir: Path, transport: str) -> LockstepConfig:
    cfg = LockstepConfig(data_dir=data_dir)
    cfg = dataclasses.replace(
        cfg,
        scheduler=dataclasses.replace(
            cfg.scheduler, redis_url="redis://127.0.0.1:1/0", transport=transport
        ),
        model=dataclasses.replace(cfg.model, dir=data_dir),
    )
    Supervisor(cfg).build()
    return config.load(data_dir / "run" / "config.json")


def test_the_gateway_reaches_the_scheduler_on_a_unix_socket_in_the_data_dir(
    tmp_path: Path,
) -> None:
    wired = _wired(tmp_path, "unix")
    sock = (tmp_path / "run" / "scheduler.sock").resolve()
    assert wired.scheduler.listen == wired.gateway.scheduler_address == f"unix:{sock}"


def test_tcp_when_asked(tmp_path: Path) -> None:
    wired = _wired(tmp_path, "tcp")
    assert wired.scheduler.listen == wired.gateway.scheduler_address
    assert wired.scheduler.listen is not None and wired.scheduler.listen.startswith("127.0.0.1:")


def test_tcp_when_the_socket_path_is_too_long(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * (MAX_UNIX_SOCKET_PATH - len(str(tmp_path.resolve()))))
    wired = _wired(deep, "unix")
    assert wired.scheduler.listen is not None and wired.scheduler.listen.startswith("127.0.0.1:")


@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_the_setting_is_a_serve_flag(transport: str) -> None:
    parser, subcommands = build_parser()
    args = parser.parse_args(["serve", "--scheduler-transport", transport])
    cfg = config.resolve(subcommands["serve"], LockstepConfig(), args, "serve")
    assert cfg.scheduler.transport == transport
