"""Token selection: greedy, temperature / top-k / top-p sampling with per-row seeded generators.

Every row owns a CPU `torch.Generator` and draws exactly one uniform number per generated token,
so a row's samples depend only on its own seed and its own logits, never on the batch it was put
into or on the device (the draw happens on the CPU; the inverse-CDF lookup uses those numbers).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

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


def make_generator(seed: int | None, sample_index: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(sample_seed(seed, sample_index))
    return gen


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its next token. temperature 0 = greedy; top_k -1 = no limit."""

    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowSampling]) -> torch.Tensor:
    """Pick one token per row of raw `logits` [R, V]. Returns int64 [R] on the same device.

    Greedy rows take the argmax (the lowest id on ties). Sampling rows scale by 1/temperature,
    keep the top_k most likely tokens, then the smallest prefix (by decreasing probability) whose
    mass reaches top_p, renormalise, and invert the CDF (in vocabulary order) at one uniform draw
    from the row's generator.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.temperature > 0.0]
    if not sampled:
        return tokens
    device = logits.device
    vocab = logits.shape[-1]
    idx = torch.tensor(sampled, dtype=torch.long, device=device)
    temps = torch.tensor([rows[i].temperature for i in sampled], dtype=torch.float64)
    uniforms = torch.empty(len(sampled), dtype=torch.float64)
    for j, i in enumerate(sampled):
        uniforms[j] = torch.rand((), generator=rows[i].generator, dtype=torch.float64)

    scaled = logits.index_select(0, idx).to(torch.float64) / temps.to(device).unsqueeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    restricted = [
        j for j, i in enumerate(sampled) if 0 < rows[i].top_k < vocab or rows[i].top_p < 1.0
    ]
    if restricted:
        # Which tokens survive top-k then top-p is decided in sorted order...
        limited = [rows[sampled[j]] for j in restricted]
        top_ks = torch.tensor(
            [r.top_k if r.top_k > 0 else vocab for r in limited], dtype=torch.long, device=device
        )
        top_ps = torch.tensor([r.top_p for r in limited], dtype=torch.float64, device=device)
        ridx = torch.tensor(restricted, dtype=torch.long, device=device)
        sorted_logits, sorted_ids = torch.sort(
            scaled.index_select(0, ridx), dim=-1, descending=True, stable=True
        )
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        drop = ranks >= top_ks.unsqueeze(-1)
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before >= top_ps.unsqueeze(-1)
        drop[:, 0] = False
        vocab_drop = torch.zeros_like(drop).scatter_(-1, sorted_ids, drop)
        probs[ridx] = probs.index_select(0, ridx).masked_fill(vocab_drop, 0.0)
    # ...but the CDF runs in vocabulary order: a tiny change of the logits (another batch shape)
    # then moves the interval boundaries by about as much, instead of reordering near-ties.
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(device) * cdf[:, -1]).unsqueeze(-1)
    # First position whose CDF exceeds the target: always a kept token with non-zero mass.
    pos = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)
    tokens[idx] = pos.squeeze(-1)
    return tokens


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k (ids, logprobs) of each row of `logprobs` [N, V], sorted by decreasing logprob."""
    k = min(k, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return ids.cpu().tolist(), values.cpu().tolist()
