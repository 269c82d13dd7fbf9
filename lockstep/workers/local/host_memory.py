"""Training on the CPU: give freed activation memory back to the OS instead of glibc's heap.

glibc serves an allocation below its mmap threshold from the heap and, each time a big mmapped
block is freed, raises that threshold (up to 32 MiB). After the first micro-batch nearly every
activation comes from the heap, and freed heap memory mostly stays in the process: the heap is
fragmented, so it cannot shrink. Measured on SmolLM2-135M, 2048 mixed tokens with activation
checkpointing: live tensors peak at ~1.3 GB while RSS peaks at 2.2 GB, and `malloc_trim` after
the pass drops RSS from 2.2 GB to 1.08 GB: the difference was freed memory glibc held on to.

Fixing the threshold (which also stops glibc moving it) at twice one micro-batch's hidden states
sends the transient big blocks (MLP intermediates, logit chunks, recomputed layers) to mmap,
returned on free, while the many hidden-state-sized blocks keep being recycled from the heap.
Measured there: peak RSS 2.2 -> 1.77 GB, step time within noise of the default (a 128 KiB
threshold gets 1.3 GB but costs +50% in page faults). Every mmapped block is faulted in afresh,
so the setting costs some speed: 5-10% on 1024-token micro-batches without checkpointing, where
live activations dominate the peak and it saves only ~10%. The engine therefore applies it with
`--activation-checkpointing` only, the mode that already trades compute for memory.
`benchmarks/engine.py --sections rss` measures the peaks.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # mallopt parameter number (glibc malloc.h)
FLOOR = 4 << 20  # never below 4 MiB: smaller blocks are frequent, and mmap faults every page


def mmap_threshold(micro_batch_tokens: int, hidden_size: int, element_size: int) -> int:
    """Twice one micro-batch's hidden states [tokens, hidden], at least FLOOR bytes."""
    return max(FLOOR, 2 * micro_batch_tokens * hidden_size * element_size)


def release_big_frees(threshold: int) -> bool:
    """Fix glibc's mmap threshold for this process. False where libc has no mallopt (musl,
    macOS): the engine works the same, it only keeps more freed memory."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        log.info("mallopt unavailable: freed CPU activation memory stays in the heap")
        return False
    log.debug("glibc mmap threshold fixed at %d bytes", threshold)
    return True
