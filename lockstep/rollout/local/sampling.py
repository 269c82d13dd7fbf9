"""Token selection: greedy, temperature / top-k / top-p sampling with per-row seeded generators.

Every row owns a CPU `torch.Generator` and draws exactly one uniform number per generated token,
so a row's samples depend only on its own seed and its own logits, never on the batch it was put
into or on the device (the draw happens on the CPU; the inverse-CDF lookup uses those numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lockstep.rollout.seeds import sample_seed


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


@dataclass(frozen=True)
class Choice:
    """The chosen token of each row and the distribution it was drawn from."""

    tokens: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R, V]: log p of the row's sampling distribution


def choose_tokens(logits: torch.Tensor, rows: Sequence[RowSampling]) -> Choice:
    """Pick one token per row of raw `logits` [R, V] (results on the same device).

    Greedy rows take the argmax (the lowest id on ties). Sampling rows scale by 1/temperature,
    keep the top_k most likely tokens, then the smallest prefix (by decreasing probability) whose
    mass reaches top_p, renormalise, and invert the CDF (in vocabulary order) at one uniform draw
    from the row's generator.

    `Choice.logprobs` is what the token was drawn from, as hosted Tinker reports it: a sampling
    row's log_softmax(logits / T) with truncated tokens at -inf and the rest renormalised; a
    greedy row's plain log_softmax(logits) (temperature 0 has no distribution of its own).
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    tokens = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.temperature > 0.0]
    if not sampled:
        return Choice(tokens, logprobs)
    device = logits.device
    vocab = logits.shape[-1]
    idx = torch.tensor(sampled, dtype=torch.long, device=device)
    temps = torch.tensor([rows[i].temperature for i in sampled], dtype=torch.float64)
    uniforms = torch.empty(len(sampled), dtype=torch.float64)
    for j, i in enumerate(sampled):
        uniforms[j] = torch.rand((), generator=rows[i].generator, dtype=torch.float64)

    scaled = logits.index_select(0, idx).to(torch.float64) / temps.to(device).unsqueeze(-1)
    probs = torch.softmax(scaled, dim=-1)
    dist = torch.log_softmax(scaled, dim=-1)
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
        kept = scaled.index_select(0, ridx).masked_fill(vocab_drop, float("-inf"))
        dist[ridx] = torch.log_softmax(kept, dim=-1)
    # ...but the CDF runs in vocabulary order: a tiny change of the logits (another batch shape)
    # then moves the interval boundaries by about as much, instead of reordering near-ties.
    cdf = probs.cumsum(dim=-1)
    targets = (uniforms.to(device) * cdf[:, -1]).unsqueeze(-1)
    # First position whose CDF exceeds the target: always a kept token with non-zero mass.
    pos = torch.searchsorted(cdf, targets, right=True).clamp_(max=vocab - 1)
    tokens[idx] = pos.squeeze(-1)
    logprobs[idx] = dist.to(logprobs.dtype)
    return Choice(tokens, logprobs)


def topk_logprobs(logprobs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Top-k (ids, logprobs) of each row of `logprobs` [N, V], sorted by decreasing logprob."""
    k = min(k, logprobs.shape[-1])
    values, ids = torch.topk(logprobs, k, dim=-1, largest=True, sorted=True)
    return ids.cpu().tolist(), values.cpu().tolist()
