"""age (filippo.io/age) encryption of exported weights, with pyrage (the age library's Rust port).

`save_weights_external(age_encryption_recipients=[...])` stores every exported file as
`<name>.age`, encrypted to all the given recipients (native `age1...` keys or SSH public keys);
the plaintext never stays on disk. The SDK and the cookbook decrypt with the recipient's identity.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeAlias

import pyrage

from lockstep.errors import UserInputError

FIELD = "age_encryption_recipients"
MAX_RECIPIENTS = 10  # the SDK's documented limit
SUFFIX = ".age"

Recipient: TypeAlias = pyrage.x25519.Recipient | pyrage.ssh.Recipient


def parse_recipients(texts: list[str]) -> list[Recipient]:
    """Every recipient parsed, or a 400 naming the field and the bad entry."""
    if len(texts) > MAX_RECIPIENTS:
        raise UserInputError(FIELD, f"at most {MAX_RECIPIENTS} recipients, got {len(texts)}")
    out: list[Recipient] = []
    for i, text in enumerate(texts):
        text = text.strip()
        try:
            if text.startswith("age1"):
                out.append(pyrage.x25519.Recipient.from_str(text))
            else:
                out.append(pyrage.ssh.Recipient.from_str(text))
        except (pyrage.RecipientError, ValueError) as exc:
            raise UserInputError(
                f"{FIELD}[{i}]", f"not an age (age1...) or SSH public key: {exc}"
            ) from None
    return out


def encrypt_tree(directory: Path, recipients: list[Recipient]) -> int:
    """Encrypt every file under `directory` in place (`f` -> `f.age`); returns the new size."""
    size = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        target = path.with_name(path.name + SUFFIX)
        pyrage.encrypt_file(str(path), str(target), recipients)
        path.unlink()
        size += target.stat().st_size
    return size
