"""`lockstep admin usage|audit|keys`: what each API key used, did and holds, for operators.

Reads the Redis of a running (or stopped, with `--redis-url`) server directly: the same
counters and audit stream the SDK's RestClient routes answer from, for every key at once.
Keys are shown by owner id (sha256 of the key, 16 hex digits), with the name a `--keys-file`
gives them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from lockstep.keyring import KeyRing

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
ADMIN_LOOKBACK_S = 100 * 365 * 86400.0


def duration(text: str) -> float:
    m = _DURATION.match(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give a duration like 90m, 24h or 7d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def add_arguments(p: argparse.ArgumentParser, default_data_dir: Path) -> None:
    p.add_argument("--data-dir", type=Path, default=default_data_dir)
    p.add_argument("--redis-url", default=None, help="default: the data dir's embedded Redis")
    p.add_argument("--keys-file", type=Path, default=None, help="names for the owner ids")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sub = p.add_subparsers(dest="admin_command", required=True)
    for name, text in (
        ("usage", "tokens, steps, samples, cycle seconds, checkpoints and custom losses per key"),
        ("audit", "the audit log (who created, deleted, published, loaded what)"),
        ("keys", "every key that has sessions: name, sessions, runs, checkpoint storage"),
    ):
        cmd = sub.add_parser(name, help=text)
        if name != "keys":
            cmd.add_argument("--since", type=duration, default=duration("24h"))
            cmd.add_argument("--owner", default=None, help="one owner id (default: all)")


def _redis_url(a: argparse.Namespace) -> str:
    if a.redis_url:
        return str(a.redis_url)
    path: Path = a.data_dir.expanduser() / "redis" / "url"
    if not path.is_file():
        raise SystemExit(f"lockstep admin: no {path}; start the server or pass --redis-url")
    return path.read_text().strip()


async def _run(a: argparse.Namespace) -> list[dict[str, object]]:
    # the scheduler's own modules, imported here so `lockstep serve` does not load them twice
    from lockstep.scheduler.observers.accounting import Accounting, Counter
    from lockstep.scheduler.state.store import Store

    store = Store.from_url(_redis_url(a))
    accounting = Accounting(store, retention_s=ADMIN_LOOKBACK_S)  # Redis trims; read it all
    names = KeyRing.load(a.keys_file).names() if a.keys_file else {}
    rows: list[dict[str, object]] = []
    try:
        if not getattr(a, "owner", None):
            await store.sessions.index_owners()  # a Redis a server never indexed
        owners = [a.owner] if getattr(a, "owner", None) else await store.sessions.owners()
        now = time.time()
        for owner in owners:
            who = {"owner": owner, "name": names.get(owner, "")}
            if a.admin_command == "usage":
                totals = {c.value: 0.0 for c in Counter}
                for b in await accounting.usage(owner, now - a.since, now + 1):
                    for c in Counter:
                        totals[c.value] += getattr(b, c.value)
                rows.append(who | totals)
            elif a.admin_command == "audit":
                for e in await accounting.audit_log(owner, now - a.since, now + 1):
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e.time))
                    rows.append(who | {"time": stamp, "event": e.event, "details": e.details_json})
            else:
                sessions, total_sessions = await store.sessions.of_owner(owner, 0, 1)
                runs = await store.runs.all_of_owner(owner)
                size = count = 0
                for run in runs:
                    for ckpt in await store.checkpoints.of_run(run):
                        count += 1
                        size += ckpt.size_bytes
                rows.append(
                    who
                    | {
                        "sessions": total_sessions,
                        "runs": len(runs),
                        "checkpoints": count,
                        "checkpoint_bytes": size,
                    }
                )
    finally:
        await store.close()
    return rows


def main(a: argparse.Namespace) -> int:
    rows = asyncio.run(_run(a))
    if a.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title=f"lockstep admin {a.admin_command}")
    for column in rows[0] if rows else ["owner"]:
        table.add_column(column)
    for row in rows:
        table.add_row(*(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()))
    Console().print(table)
    return 0
