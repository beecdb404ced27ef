"""A night's processes give their freed heap back (issue 47: a CPU night was killed for memory at 24 GiB, its idle
workers and its judging holding what they had freed)."""

import ctypes
import os
import sys

import pytest

from harness import resources


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc: Linux only")
def test_freed_heap_pages_go_back_to_the_system():
    """200 MB of small blocks freed below one block still held: glibc keeps their pages (the heap cannot shrink
    past the block held at its top) until ``give_back_freed_memory`` hands them back."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4000) for _ in range(50_000)]
    for block in blocks:
        ctypes.memset(block, 1, 4000)  # touched: resident
    top = libc.malloc(4000)
    for block in blocks:
        libc.free(block)
    kept = _resident_bytes()
    resources.give_back_freed_memory()
    given_back = kept - _resident_bytes()
    libc.free(top)
    assert given_back > 150_000_000, given_back
