"""API keys with names and optional quotas, from a TOML file (`--keys-file`), reloaded on SIGHUP.

    [[key]]
    name = "alice"                # shown by `lockstep admin`
    key = "tml-alice-..."         # the X-API-Key value
    max_training_runs = 8         # optional quota: training runs this key may create (0: none)
    revoked = false               # a revoked (or removed) key gets 401 from the next request on
    admin = false                 # optional: also sees every key's runs and usage (read only)

Adding a tenant is an edit and `kill -HUP <lockstep serve pid>`, no restart.
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from pathlib import Path

import msgspec


def owner_of(api_key: str) -> str:
    """The stable owner id the scheduler scopes everything to: sha256(key) hex, 16 chars."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


class KeyEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    key: str
    max_training_runs: int = 0
    revoked: bool = False
    admin: bool = False


class _File(msgspec.Struct, forbid_unknown_fields=True):
    key: list[KeyEntry] = []


class KeyRing:
    def __init__(self, entries: list[KeyEntry]) -> None:
        self.entries = entries

    @classmethod
    def load(cls, path: Path) -> KeyRing:
        """Parse and check the file; a ValueError names the problem (the old ring stays)."""
        try:
            parsed = msgspec.convert(tomllib.loads(path.read_text()), _File)
        except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
        seen_names: set[str] = set()
        seen_keys: set[str] = set()
        for e in parsed.key:
            if not e.name or not e.key:
                raise ValueError(f"{path}: every [[key]] needs a name and a key")
            if e.name in seen_names or e.key in seen_keys:
                raise ValueError(f"{path}: key {e.name!r} is listed twice")
            if e.max_training_runs < 0:
                raise ValueError(f"{path}: {e.name}: max_training_runs must be >= 0")
            seen_names.add(e.name)
            seen_keys.add(e.key)
        return cls(parsed.key)

    def lookup(self, api_key: str) -> KeyEntry | None:
        """The entry of this key (compared with every entry, so timing does not tell which)."""
        found = None
        for e in self.entries:
            if hmac.compare_digest(e.key.encode(), api_key.encode()):
                found = e
        return found

    def names(self) -> dict[str, str]:
        """owner id -> name."""
        return {owner_of(e.key): e.name for e in self.entries}
