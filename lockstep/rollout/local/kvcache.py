"""A left-padded, batched KV cache over HF `DynamicCache` with row surgery.

Layout: every layer holds keys/values [rows, kv_heads, L, head_dim] where row r's real tokens are
the LAST positions of the L columns; `mask` [rows, L] (int64, 1 = real) marks them. A row's own
positions are passed explicitly as position ids, so left padding never shifts RoPE. Padding
columns are masked out of attention: with eager attention they get an exact zero weight, so a row's
numbers do not depend on how much padding its batch carries.

Supported surgery: merge several prefill caches (different padded lengths) into one decode batch,
select / repeat rows (finished rows leave, samples of one prompt share its prefill), and trim
leading columns that became padding for every remaining row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


def _layers(cache: DynamicCache) -> list[tuple[DynamicLayer, torch.Tensor, torch.Tensor]]:
    """(layer, keys, values) of every layer; all must be filled full-attention layers."""
    out = []
    for layer in cache.layers:
        if not isinstance(layer, DynamicLayer) or layer.keys is None or layer.values is None:
            raise TypeError(f"unsupported or empty cache layer {type(layer).__name__}")
        out.append((layer, layer.keys, layer.values))
    return out


@dataclass
class BatchCache:
    cache: DynamicCache
    mask: torch.Tensor  # int64 [rows, L]

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def layers_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(keys, values) for _, keys, values in _layers(self.cache)]

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (int64, may repeat rows), in that order."""
        for layer, keys, values in _layers(self.cache):
            layer.keys = keys.index_select(0, index)
            layer.values = values.index_select(0, index)
        self.mask = self.mask.index_select(0, index)

    def append_real_column(self) -> torch.Tensor:
        """Extend the mask by one real column (the token about to be fed); returns the mask."""
        ones = torch.ones((self.rows, 1), dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        return self.mask

    def trim_padding(self) -> None:
        """Drop leading columns that are padding in every row."""
        real = self.mask.any(dim=0)
        if bool(real.all()):
            return
        first = int(torch.nonzero(real, as_tuple=True)[0][0]) if bool(real.any()) else 0
        if first == 0:
            return
        for layer, keys, values in _layers(self.cache):
            layer.keys = keys[:, :, first:, :]
            layer.values = values[:, :, first:, :]
        self.mask = self.mask[:, first:]


def merge(
    parts: Sequence[BatchCache], rows: Sequence[tuple[int, int]], config: PretrainedConfig
) -> BatchCache:
    """One cache whose row j is row `rows[j][1]` of part `rows[j][0]`.

    Shorter parts are left-padded with zero keys/values (masked out) to the longest length.
    """
    length = max(int(p.mask.shape[1]) for p in parts)
    device = parts[0].mask.device
    per_part_kv = [p.layers_kv() for p in parts]
    n_layers = len(per_part_kv[0])
    # Consecutive rows of one part are gathered with one index_select.
    runs: list[tuple[int, list[int]]] = []
    for part, row in rows:
        if runs and runs[-1][0] == part:
            runs[-1][1].append(row)
        else:
            runs.append((part, [row]))

    def gather(tensor: torch.Tensor, part: int, picked: list[int]) -> torch.Tensor:
        index = torch.tensor(picked, dtype=torch.long, device=device)
        pad = length - int(parts[part].mask.shape[1])
        selected = tensor.index_select(0, index)
        if pad == 0:
            return selected
        if selected.dim() == 2:  # mask [rows, L]
            return F.pad(selected, (pad, 0), value=0)
        return F.pad(selected, (0, 0, pad, 0), value=0.0)  # [rows, heads, L, dim]

    kv_data = []
    for layer in range(n_layers):
        keys = torch.cat([gather(per_part_kv[p][layer][0], p, picked) for p, picked in runs])
        values = torch.cat([gather(per_part_kv[p][layer][1], p, picked) for p, picked in runs])
        kv_data.append((keys, values))
    mask = torch.cat([gather(parts[p].mask, p, picked) for p, picked in runs])
    return BatchCache(DynamicCache(ddp_cache_data=kv_data, config=config), mask)


class UnpaddedBatch:
    """Rows of one length, no padding, over any HF cache (full, sliding-window, latent or
    recurrent layers): row selection is the only surgery (`Cache.reorder_cache`, which every
    layer type implements), so no column is ever padded, merged or trimmed."""

    def __init__(self, cache: DynamicCache) -> None:
        self.cache = cache

    def select(self, index: torch.Tensor) -> None:
        """Keep rows `index` (int64, may repeat rows), in that order."""
        self.cache.reorder_cache(index)  # type: ignore[arg-type]  # LongTensor is an int64 Tensor

    def append_real_column(self) -> None:
        """No mask: every column is real (HF builds the causal and window masks itself)."""
        return None

    def trim_padding(self) -> None:
        return None
