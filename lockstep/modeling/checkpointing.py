"""Per-layer activation checkpointing of a decoder's layers, chosen per micro-batch.

A checkpointed layer keeps only its input during the forward and runs again during backward
(torch's non-reentrant checkpoint); the others keep their activations. Which layers are
checkpointed is set for each micro-batch (`LayerCheckpoints.only`), so the trainer pays the
recompute only where a pass would not fit its memory budget otherwise. Independent of
transformers' own switch (its name and its train-mode condition change between releases): the
layers' forwards are wrapped once, at load.

The recompute runs the same operations on the same inputs, so a checkpointed pass gives the
numbers the plain pass gives. It must run inside whatever context the forward ran in (the
trainer calls backward inside its row routing).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class LayerCheckpoints:
    """The decoder `layers`, each checkpointed while its index is in `active`."""

    def __init__(self, layers: Iterable[nn.Module]) -> None:
        self.active: frozenset[int] = frozenset()
        self.count = 0
        for index, layer in enumerate(layers):
            layer.forward = self._wrapped(index, layer.forward)
            self.count += 1

    def _wrapped(self, index: int, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if index in self.active and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        return run

    @contextmanager
    def only(self, layers: Collection[int]) -> Iterator[None]:
        """Checkpoint `layers` (indices) for the forward and backward run inside."""
        before, self.active = self.active, frozenset(layers)
        try:
            yield
        finally:
            self.active = before
