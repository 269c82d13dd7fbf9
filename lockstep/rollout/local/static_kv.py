"""Static-shape decode for the padded path (`--sampler-decode static`).

The merged prefill cache of a generation (left-padded, `kvcache.BatchCache`) is copied into
transformers' `StaticCache` tensors [rows, kv_heads, capacity, head_dim], capacity = the batch's
padded prompt width + its longest generation, so every decode step has the same shapes:

- every row writes the same next column (the cache's own device-side counter); a row's positions
  are explicit, so left padding never shifts RoPE;
- the attention mask is an additive [rows, 1, 1, capacity] tensor kept across steps: a column
  opens (0) when it is written, padding and future columns stay at the dtype's minimum (what
  transformers' eager mask puts there: an exact zero weight after the softmax);
- token ids and positions are [rows, 1] buffers filled in place.

Finished rows stay in the batch (their outputs are dropped) until at most half the rows are live,
or a finished row's adapter is used by no live row any more (it may then be unloaded): the live
rows are then copied into a smaller batch, a new shape.

On CUDA the step of each batch shape is captured as a CUDA graph after one eager step (which
also fills the routing's device constants, so the capture copies nothing from the host) and
replayed from then on; the graph keeps the routing and the adapter weights it read alive. A model
whose step cannot be captured (a capture that fails, logged once and said by the sampler's
capabilities) runs the same static step eagerly. Routed experts are captured too: their
(token, expert) grouping has the step's shapes and reads nothing back to the host
(`modeling/experts.py`), unless one layer's (adapter, expert) groups exceed what the grouped
GEMM takes in one call (then the capture fails on that read, and the steps run eagerly).
On a CPU the step always runs eagerly (what CI compares with the eager path). A batch whose
whole capacity would take over half the free GPU memory keeps the eager, growing cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from lockstep.modeling.lora import LoraModel
from lockstep.rollout.local.kvcache import BatchCache

log = logging.getLogger(__name__)


def static_refusal(padded: bool, vision: bool) -> str | None:
    """Why a model decodes eagerly even when static decode is asked for (None: it does not)."""
    if not padded:
        return (
            "its cache is not plain full attention (sliding windows, attention sinks, linear "
            "attention or state-space layers keep per-layer state that a fixed-capacity cache "
            "of keys and values cannot hold)"
        )
    if vision:
        return "vision-language models feed M-RoPE positions the static step does not build"
    return None


def graph_refusal(device: torch.device) -> str | None:
    """Why static steps run eagerly instead of as CUDA graphs (None: they are captured)."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    return None


class StaticDecoder:
    """Builds `StaticBatch`es for one model; `graphs`: capture CUDA graphs (CUDA only)."""

    def __init__(self, lora: LoraModel, pad_id: int, graphs: bool, cache_arg: str) -> None:
        self.lora = lora
        self.model: PreTrainedModel = lora.base
        self.cache_arg = cache_arg  # the KV cache's keyword (`cache_argument`)
        self.pad_id = pad_id
        self.graphs = graphs
        self.graph_failure: str | None = None  # why capture failed once (then never retried)

    def batch(
        self, merged: BatchCache, adapters: Sequence[str | None], new_tokens: int
    ) -> StaticBatch | None:
        """`merged`'s rows in a static batch with room for `new_tokens` more columns; None
        when its whole capacity would take more than half the free GPU memory (the eager
        cache grows only as far as the rows get and shrinks as they finish)."""
        width = int(merged.mask.shape[1])
        capacity = width + max(1, new_tokens)
        kv = merged.layers_kv()
        if merged.mask.device.type == "cuda":
            need = sum(k.nbytes + v.nbytes for k, v in kv) * capacity // max(1, width)
            free, _ = torch.cuda.mem_get_info(merged.mask.device)
            if need > free // 2:
                log.info(
                    "sampler: a batch of %d rows x %d columns decodes eagerly: its static cache "
                    "(%d MiB) would take over half the free GPU memory",
                    merged.rows,
                    capacity,
                    need >> 20,
                )
                return None
        return StaticBatch(self, kv, merged.mask, list(adapters), capacity)

    def forward(self, batch: StaticBatch) -> torch.Tensor:
        """One decode step of every row of `batch` (routing set by the caller): raw logits
        [rows, 1, V] in the model's dtype."""
        out = self.model(
            input_ids=batch.ids,
            attention_mask=batch.mask,
            position_ids=batch.positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: batch.cache},
        )
        logits: torch.Tensor = out.logits
        return logits


class _Graph:
    """A captured step and everything its kernels read that nothing else keeps alive."""

    def __init__(self, graph: Any, logits: torch.Tensor, keep: list[object]) -> None:
        self.graph = graph
        self.logits = logits
        self.keep = keep


class StaticBatch:
    """Rows decoding over a fixed-capacity cache (module docstring)."""

    def __init__(
        self,
        decoder: StaticDecoder,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        mask: torch.Tensor,
        adapters: list[str | None],
        capacity: int,
    ) -> None:
        self._decoder = decoder
        self.capacity = capacity
        self.column = int(mask.shape[1])  # the next column a step writes
        rows, device = int(mask.shape[0]), mask.device
        dtype = kv[0][0].dtype
        self.cache = _static_cache(decoder.model, kv, capacity)
        closed = torch.finfo(dtype).min
        self.mask = torch.full((rows, 1, 1, capacity), closed, dtype=dtype, device=device)
        self.mask[:, 0, 0, : self.column].masked_fill_(mask.bool(), 0.0)
        self.ids = torch.full((rows, 1), decoder.pad_id, dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.adapters = adapters  # of every batch row, finished or not
        self.slots = list(range(rows))  # the batch row of each live row, in order
        self._slot_index = torch.arange(rows, device=device)
        self._graph: _Graph | None = None

    @property
    def rows(self) -> int:
        return len(self.adapters)

    @property
    def captured(self) -> bool:
        """Whether its step replays as a CUDA graph."""
        return self._graph is not None

    def keep(self, live: list[int]) -> None:
        """Keep live rows `live` (indices into the live rows, in order); the others finished."""
        self.slots = [self.slots[j] for j in live]
        used = {self.adapters[s] for s in self.slots}
        if 2 * len(self.slots) <= self.rows or any(a not in used for a in self.adapters):
            self._compact()
        else:
            self._slot_index = torch.tensor(self.slots, dtype=torch.long, device=self.ids.device)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Feed each live row its token (int64 [n]) at its position (int64 [n, 1]): the next
        logits of the live rows, fp32 [n, V]."""
        if self.column >= self.capacity:
            raise RuntimeError(f"static batch full at {self.capacity} columns")
        self.ids.index_copy_(0, self._slot_index, tokens.unsqueeze(-1))
        self.positions.index_copy_(0, self._slot_index, positions)
        self.mask[:, :, :, self.column] = 0.0
        logits = self._run()
        self.column += 1
        return logits[:, -1, :].index_select(0, self._slot_index).float()

    def _run(self) -> torch.Tensor:
        decoder = self._decoder
        if self._graph is not None:
            self._graph.graph.replay()
            return self._graph.logits
        if not decoder.graphs or decoder.graph_failure is not None:
            with decoder.lora.row_adapters(self.adapters):
                return decoder.forward(self)
        return self._capture()

    def drop_graph(self) -> None:
        """Forget the captured step (an adapter it read was replaced: capture again)."""
        self._graph = None

    def _capture(self) -> torch.Tensor:
        """Run this step eagerly (on a side stream, as capture wants), then capture the next
        steps' graph with the same routing; a capture that fails leaves eager steps."""
        decoder = self._decoder
        with decoder.lora.row_adapters(self.adapters) as routing:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch's stub
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                logits = decoder.forward(self)  # the real step; also warms the routing
            torch.cuda.current_stream().wait_stream(side)
            logits.record_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            try:  # thread_local: another thread's CUDA call does not void the capture
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    captured = decoder.forward(self)
            except Exception as exc:  # noqa: BLE001  # any capture failure: eager from here on
                decoder.graph_failure = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "sampler: CUDA graph capture of the decode step failed (%s); static decode "
                    "steps run eagerly",
                    decoder.graph_failure,
                )
                torch.cuda.synchronize()
                return logits
        weights = [p for a in set(self.adapters) if a for p in decoder.lora.adapter_parameters(a)]
        self._graph = _Graph(graph, captured, [routing, *weights])
        return logits

    def _compact(self) -> None:
        """Copy the live rows into a batch of their own (a new shape: a new graph)."""
        index = torch.tensor(self.slots, dtype=torch.long, device=self.ids.device)
        for layer, keys, values in _layers(self.cache):
            layer.keys = keys.index_select(0, index)
            layer.values = values.index_select(0, index)
            layer.batch_size = len(self.slots)
        self.mask = self.mask.index_select(0, index)
        self.ids = self.ids.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.adapters = [self.adapters[s] for s in self.slots]
        self.slots = list(range(len(self.slots)))
        self._slot_index = torch.arange(len(self.slots), device=self.ids.device)
        self._graph = None


def _static_cache(
    model: PreTrainedModel, kv: list[tuple[torch.Tensor, torch.Tensor]], capacity: int
) -> StaticCache:
    """A `StaticCache` of `capacity` columns holding `kv` (per layer [rows, heads, L, dim]) in
    its first L columns, its counter at L."""
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    if len(cache.layers) != len(kv):
        raise ValueError(f"{len(cache.layers)} static cache layers for {len(kv)} cached layers")
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        if type(layer) is not StaticLayer:  # no window, no other kind of layer
            raise TypeError(f"unsupported static cache layer {type(layer).__name__}")
        layer.lazy_initialization(keys, values)
    for (layer, static_keys, static_values), (keys, values) in zip(_layers(cache), kv, strict=True):
        length = keys.shape[2]
        static_keys[:, :, :length].copy_(keys)
        static_values[:, :, :length].copy_(values)
        layer.cumulative_length.fill_(length)
    return cache


def _layers(cache: StaticCache) -> list[tuple[StaticLayer, torch.Tensor, torch.Tensor]]:
    """(layer, keys, values) of every layer: filled plain static layers (no window)."""
    out = []
    for layer in cache.layers:
        if type(layer) is not StaticLayer or layer.keys is None or layer.values is None:
            raise TypeError(f"unsupported or empty static cache layer {type(layer).__name__}")
        out.append((layer, layer.keys, layer.values))
    return out
