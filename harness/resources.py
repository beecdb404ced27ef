"""Storage and memory at the harness's boundaries: the one place that turns an OSError or a size that cannot
fit into one clear line naming the path (or the size it would need).

Every phase that writes (the reports folder, a checkpoint, a runner's folder, the report) runs inside
``boundary(what, folder)``; an OSError there becomes a ``StorageError`` saying what could not be written, where,
and why (no space left, read-only, a file where a folder should be, permission denied), even when the OSError
itself names no file (a ``write`` that hits a full disk). Tensors are sized before they are made
(``check_memory``), so a token count that cannot fit is refused with the size it would need; so is the disk a case
will write (``harness.pipeline.disk_budget``, from ``free_disk``).
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REASONS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "exists and is not a folder",
    errno.EISDIR: "is a folder, not a file",
    errno.ENAMETOOLONG: "name too long",
    errno.EIO: "input/output error",
}
# A run whose tensors alone exceed the memory available now cannot succeed (the runners load them again, so
# this refuses only the hopeless; a run near the limit may still fail, as a runner crash with its reason).
MEMORY_SHARE = 1.0


class StorageError(OSError):
    """A file or folder the harness could not write or read; the message names the path and why."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.message, self.code = message, code

    def __str__(self) -> str:
        return self.message


class ResourceError(RuntimeError):
    """The run needs more memory than this machine has; the message says how much."""


def describe(error: OSError, what: str, where: Path | str | None = None) -> str:
    """``cannot write <what> <path>: <why>``; the path is the error's own file, else the folder being written."""
    if isinstance(error, StorageError):
        return error.message
    path = error.filename or where
    reason = REASONS.get(error.errno) or error.strerror or type(error).__name__
    if isinstance(error, FileExistsError) and path and Path(path).exists() and not Path(path).is_dir():
        reason = "exists and is a file, not a folder"
    other = f" (and {error.filename2})" if error.filename2 else ""
    return f"cannot write {what} {path}{other}: {reason}" if path else f"cannot write {what}: {reason}"


@contextmanager
def boundary(what: str, where: Path | str | None = None) -> Iterator[None]:
    """Turn any OSError inside into a StorageError naming `what` and the path (an inner StorageError stays)."""
    try:
        yield
    except StorageError:
        raise
    except OSError as error:
        raise StorageError(describe(error, what, where), error.errno) from None


def available_memory() -> int | None:
    """Bytes of memory available now (MemAvailable), or None where the system does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def give_back_freed_memory() -> None:
    """Return the heap's freed pages to the system (glibc's ``malloc_trim``; elsewhere nothing): a process that
    read or ran a large step frees it, but glibc keeps the pages, so a night's idle workers and its judging held
    gigabytes they no longer used (issue 47: a CPU night was killed for memory at 24 GiB). Changes no computation."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def free_disk(folder: Path) -> tuple[int, int]:
    """(bytes free to this user, device id) of the file system that holds `folder`, or that will: its nearest
    existing parent."""
    place = Path(folder).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    return shutil.disk_usage(place).free, place.stat().st_dev


def check_memory(need: int, what: str) -> None:
    """ResourceError when `need` bytes exceed the share of available memory one run may claim."""
    available = available_memory()
    if available is not None and need > available * MEMORY_SHARE:
        raise ResourceError(f"{what} need {human_bytes(need)}, more than this machine can hold "
                            f"({human_bytes(available * MEMORY_SHARE)} of memory available now); "
                            "use fewer tokens or smaller shapes")


def human_bytes(count: int | float) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if value < 1024 or unit == "EiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} EiB"


def safetensors_keys(file: Path, error: type[Exception] = ValueError) -> list[str]:
    """The tensor names of a safetensors file, reading its header only; a file that is not one raises `error` (the
    caller's own error type) naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="numpy") as handle:
            return list(handle.keys())
    except Exception as problem:  # safetensors raises several unrelated types for a bad file
        raise error(f"{file}: not a readable safetensors file: {problem}") from None
