"""The CPU engine's allocator tuning (launch.tune_host_allocator)."""

from __future__ import annotations

import platform
import resource
import subprocess
import sys

import pytest

from gearshift.worker.launch import tune_host_allocator

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# A step's pattern: several activations of 12 MiB live at once, then all freed; 100 rounds,
# every page touched: page faults per round.
PROBE = """
import resource, sys, ctypes
from gearshift.worker.launch import tune_host_allocator
if sys.argv[1] == "tuned":
    assert tune_host_allocator()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
size = 12 << 20
def once():
    blocks = [libc.malloc(size) for _ in range(4)]
    for p in blocks:
        ctypes.memset(p, 1, size)
    for p in reversed(blocks):
        libc.free(ctypes.c_void_p(p))
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(100):
    once()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 100)
"""


def _faults_per_round(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return float(out.stdout.strip())


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
@pytest.mark.slow
def test_large_freed_blocks_stay_mapped_once_tuned():
    assert tune_host_allocator()
    # Untuned, glibc gives the freed blocks back to the kernel (unmapped or trimmed off the heap)
    # and the next round faults their pages in again; tuned, they stay on the heap, warm.
    assert _faults_per_round("default") > 1000
    assert _faults_per_round("tuned") < 50


def test_a_process_without_glibc_is_left_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert tune_host_allocator() is False
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt >= 0
