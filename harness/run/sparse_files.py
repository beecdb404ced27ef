"""Zero blocks of a written file given back to the disk, its bytes unchanged (issue 47: a MoE training step is a third
zeros, the gradients and optimizer state of the experts no token reached, and a night's peak is its step files).

``punch_zeros`` finds the file-system blocks that hold only zero bytes and punches them out (Linux ``fallocate`` with
``FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE``): the file keeps its size and every reader reads the same bytes (a hole
reads as zeros), so nothing that compares, digests or copies it sees a difference; only the disk it takes shrinks.
Where the system or file system cannot punch holes the file stays as it was written.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

import numpy as np

PUNCH_HOLE = 0x02  # FALLOC_FL_PUNCH_HOLE (linux/falloc.h)
KEEP_SIZE = 0x01  # FALLOC_FL_KEEP_SIZE: must go with PUNCH_HOLE
CHUNK_BYTES = 32 << 20  # read back a chunk at a time: memory stays at a chunk whatever the file's size


def punch_zeros(path) -> int:
    """Punch out every all-zero block of the file at `path`; the bytes of disk given back (0 where holes cannot be
    punched: another system, a file system without them)."""
    fallocate = _fallocate()
    if fallocate is None:
        return 0
    fd = os.open(path, os.O_RDWR)
    try:
        block = os.fstat(fd).st_blksize
        freed = 0
        for start, length in _zero_runs(fd, block):
            if fallocate(fd, PUNCH_HOLE | KEEP_SIZE, ctypes.c_int64(start), ctypes.c_int64(length)) != 0:
                return freed  # EOPNOTSUPP and the like: what is punched is punched, the rest stays written
            freed += length
        return freed
    finally:
        os.close(fd)


def _zero_runs(fd: int, block: int):
    """(offset, length) of each run of whole blocks that hold only zeros, in file order (a run that goes on past a
    chunk comes as two: punched apart, the same holes); a last, partial block stays written."""
    chunk = max(1, CHUNK_BYTES // block) * block
    offset = 0
    while data := os.pread(fd, chunk, offset):
        blocks = len(data) // block
        zero = ~np.frombuffer(data, np.uint8, blocks * block).reshape(blocks, block).any(axis=1)
        edges = np.flatnonzero(np.diff(np.concatenate(([0], zero.astype(np.int8), [0]))))
        for first, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
            yield offset + first * block, (end - first) * block
        offset += len(data)


@functools.cache  # find_library asks ldconfig: once a process
def _fallocate():
    """libc's fallocate on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    function = getattr(libc, "fallocate64", None) or getattr(libc, "fallocate", None)
    if function is not None:
        function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        function.restype = ctypes.c_int
    return function
