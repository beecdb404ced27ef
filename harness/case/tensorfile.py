"""safetensors files the checkpoint writer fills block by block, and their headers read without loading any data.

Why not ``safetensors.numpy.save_file``: it needs every tensor whole in memory at once, where a checkpoint's blocks
are made in parallel (``harness.case.generate``) and written, hashed and dropped one after another, so a 2.3 GB
embedding table never exists twice (or at all) in the harness's memory. The files are ordinary safetensors files
(a little-endian u64 header length, a JSON header padded with spaces to 8 bytes, then the data): every
framework's ``safetensors`` reads them. Tensors are laid out widest dtype first, then by name, as safetensors
itself orders them, so every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64", "int32": "I32",
         "int16": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL"}
NAMES = {code: name for name, code in CODES.items()}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "U16": 2,
            "U32": 4, "U64": 8, "BOOL": 1}
MAX_HEADER = 100 * 2**20  # safetensors' own limit


class BadFile(ValueError):
    """A file that is not a safetensors file this module can read; the message says what is wrong."""


def layout(tensors: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The file's header bytes and each tensor's [begin, end) byte range in the data, for {name: (dtype, shape)}."""
    order = sorted(tensors, key=lambda name: (-np.dtype(tensors[name][0]).itemsize, name))
    entries, ranges, offset = {}, {}, 0
    for name in order:
        dtype, shape = np.dtype(tensors[name][0]), tuple(int(n) for n in tensors[name][1])
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        ranges[name] = (offset, offset + size)
        entries[name] = {"dtype": CODES[dtype.name], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ranges


def read_header(path: Path) -> tuple[dict[str, dict], int]:
    """{name: {"dtype": numpy name, "shape", "data_offsets"}} and where the data starts; BadFile when the file is not
    a whole safetensors file (a header that does not parse, or data shorter than the header says)."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(8)
            if len(raw) < 8:
                raise BadFile(f"{size} bytes, shorter than a header length")
            length = struct.unpack("<Q", raw)[0]
            if length > min(MAX_HEADER, size - 8):
                raise BadFile(f"header length {length} does not fit the file's {size} bytes")
            header = json.loads(handle.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadFile(str(error)) from None
    if not isinstance(header, dict):
        raise BadFile("the header is not a JSON object")
    header.pop("__metadata__", None)
    tensors, end = {}, 0
    for name, entry in header.items():
        try:
            begin, stop = (int(n) for n in entry["data_offsets"])
            tensors[name] = {"dtype": NAMES[entry["dtype"]], "shape": [int(n) for n in entry["shape"]],
                             "data_offsets": [begin, stop]}
        except (KeyError, TypeError, ValueError):
            raise BadFile(f"tensor {name!r} has a malformed header entry {entry!r:.120}") from None
        end = max(end, stop)
    if 8 + length + end != size:
        raise BadFile(f"the header describes {8 + length + end} bytes, the file has {size}")
    return tensors, 8 + length


HASH_THREADS = min(8, os.cpu_count() or 1)


def sha256s(path: Path, hasher) -> dict[str, str]:
    """Each tensor's digest (`hasher` a hashlib constructor) over its bytes in the file, read through a memory map:
    no copy of the data is made. ``HASH_THREADS`` tensors are hashed at once, the largest first (hashlib releases the
    GIL over large buffers): Kimi-K2's full-width weights, 8.8 GB, 6.5-6.9 s on one thread of the H200's host, 1.8-1.9 s
    on 8."""
    tensors, start = read_header(path)
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == start:  # no data at all (every tensor empty): nothing to map
            return {name: hasher().hexdigest() for name in tensors}
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            def one(name: str) -> str:
                begin, end = tensors[name]["data_offsets"]
                with view[start + begin:start + end] as data:
                    return hasher(data).hexdigest()

            largest_first = sorted(tensors, key=lambda n: tensors[n]["data_offsets"][0] - tensors[n]["data_offsets"][1])
            with ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="sha256") as pool:
                found = dict(zip(largest_first, pool.map(one, largest_first), strict=True))
    return {name: found[name] for name in tensors}


def flip_bit(path: Path, name: str, index: tuple[int, ...], bit: int) -> None:
    """Flip one bit of one element of tensor `name`, in place in the file (a negative control's planted difference)."""
    tensors, start = read_header(path)
    entry = tensors[name]
    itemsize = ITEMSIZE[CODES[entry["dtype"]]]
    offset = start + entry["data_offsets"][0] + int(np.ravel_multi_index(index, entry["shape"])) * itemsize
    with open(path, "r+b") as handle:
        handle.seek(offset)
        value = bytearray(handle.read(itemsize))
        value[bit // 8] ^= 1 << (bit % 8)  # little-endian: bit b of the element is bit b % 8 of byte b // 8
        handle.seek(offset)
        handle.write(value)

