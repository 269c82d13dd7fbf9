"""Training on the CPU: where glibc puts freed activation memory, one setting per trainer mode.

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

Without checkpointing (speed over memory) the opposite: blocks up to glibc's largest threshold
(32 MiB, where its dynamic threshold ends up anyway) come from the heap, and freed memory at the
heap's top stays in the process up to one micro-batch's pass bytes (`engine.memory.PassCost`,
at least twice that ceiling as glibc's own rule keeps), which the next micro-batch takes again.
glibc's rule gives back what exceeds twice its threshold, so each 1024-token micro-batch
faulted its activations in afresh: tiny Qwen3, 8 tenants x 256 tokens (two micro-batches),
2-4.5k page faults and 3-9 ms of system time per step, ~0 with the setting.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameter numbers (glibc malloc.h)
FLOOR = 4 << 20  # never below 4 MiB: smaller blocks are frequent, and mmap faults every page
CEILING = 32 << 20  # glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
INT_MAX = (1 << 31) - 1


def mmap_threshold(micro_batch_tokens: int, hidden_size: int, element_size: int) -> int:
    """Twice one micro-batch's hidden states [tokens, hidden], at least FLOOR bytes."""
    return max(FLOOR, 2 * micro_batch_tokens * hidden_size * element_size)


def release_big_frees(threshold: int) -> bool:
    """Fix glibc's mmap threshold for this process. False where libc has no mallopt (musl,
    macOS): the engine works the same, it only keeps more freed memory."""
    return _mallopt({M_MMAP_THRESHOLD: threshold}, "freed CPU activation memory stays in the heap")


def keep_for_next_pass(pass_bytes: int) -> bool:
    """Blocks up to CEILING from the heap, and up to `pass_bytes` of freed heap kept for the next
    micro-batch (module docstring). False where libc has no mallopt: the engine works the same,
    it only faults more pages in."""
    trim = min(max(pass_bytes, 2 * CEILING), INT_MAX)  # mallopt takes a C int
    settings = {M_MMAP_THRESHOLD: CEILING, M_TRIM_THRESHOLD: trim}
    return _mallopt(settings, "freed CPU activation memory goes back to the OS after each pass")


def _mallopt(settings: dict[int, int], otherwise: str) -> bool:
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None or not all(mallopt(k, v) == 1 for k, v in settings.items()):
        log.info("mallopt unavailable: %s", otherwise)
        return False
    log.debug("glibc malloc settings: %s", settings)
    return True
