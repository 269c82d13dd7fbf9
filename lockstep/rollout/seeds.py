"""Per-sample seeds shared by every sampling engine (no torch: the HTTP engines import it too)."""

from __future__ import annotations

import secrets

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(seed: int | None, sample_index: int) -> int:
    """The generator seed of sample `sample_index` of a request (random when `seed` is None).

    Seeds may be any 64-bit value (negative too); distinct (seed, index) pairs give unrelated
    streams, so the samples of one request differ and seed 5 / sample 1 is not seed 6 / sample 0.
    """
    if seed is None:
        return secrets.randbits(64)
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (sample_index & _MASK64))
