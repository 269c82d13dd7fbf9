"""The CPU trainer's allocator setting (lockstep.workers.local.host_memory) returns freed big
blocks to the OS.

Each case runs in a fresh interpreter (the setting is process-wide): it allocates 8 MiB tensors
with a small long-lived tensor after each (which pins the heap's top, as a training step's
long-lived tensors do), frees the big ones, and reports how much RSS stayed behind. With glibc's
dynamic threshold the big blocks come from the heap after the first free and stay resident; with
the threshold fixed below them they are mmapped and go back on free.
"""

from __future__ import annotations

import ctypes.util
import json
import platform
import subprocess
import sys

import pytest

from lockstep.workers.local import host_memory

PROBE = """
import json, sys
import torch
from lockstep.workers.local import host_memory
if sys.argv[1] == "fixed":
    assert host_memory.release_big_frees(host_memory.mmap_threshold(1024, 576, 4))
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big, pins = [], []
before = rss()
for _ in range(3):  # rounds: after the first free glibc moves its threshold up
    for _ in range(48):
        big.append(torch.ones(1 << 21))  # 8 MiB
        pins.append(torch.ones(64))
    big.clear()
print(json.dumps({"kept_mib": (rss() - before) / 2**20}))
"""

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt's mmap threshold is glibc's; other C libraries keep their own policy",
)


def kept_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["kept_mib"])


def test_threshold_rule() -> None:
    assert host_memory.mmap_threshold(1024, 576, 4) == 2 * 1024 * 576 * 4
    assert host_memory.mmap_threshold(16, 64, 4) == host_memory.FLOOR


@glibc
def test_freed_big_blocks_leave_the_process() -> None:
    assert ctypes.util.find_library("c")
    default, fixed = kept_mib("default"), kept_mib("fixed")
    print(f"RSS kept after freeing 48 x 8 MiB: glibc default {default:.0f} MiB, fixed {fixed:.0f}")
    assert fixed < 32, fixed  # 384 MiB freed: at most a few blocks' worth may stay
    assert default > 4 * fixed + 64, (default, fixed)  # the default keeps them (why this exists)
