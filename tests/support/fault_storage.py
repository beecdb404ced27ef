"""Storage faults for tests: a real full or read-only file system where this machine allows one, else a named
double.

``private_mounts(mounts, command)`` runs `command` in a private mount namespace (``unshare --mount``, as root or
in a user namespace) with a small tmpfs on each folder: ``"full"`` (a few KiB: the disk fills up) or
``"ro"`` (read-only). Nothing outside that process sees the mounts, and they vanish with it.
Where no mount namespace can be made (or ``FAULT_NO_MOUNTS=1``), ``double_command`` runs the command with
``FullDiskDouble`` or ``ReadOnlyDouble`` patched in at the harness's write boundary instead (every write under
the folder raises ENOSPC or EROFS, as the kernel would; the disk budget's free-space probe says what the full tmpfs
has free).
"""

from __future__ import annotations

import errno
import functools
import os
import shlex
import shutil
import subprocess
import sys

OPTIONS = {"full": "size=8k,nr_inodes=64", "ro": "ro,size=64k"}
FULL_FREE = 8 << 10  # what the "full" tmpfs has free when mounted, and what its double's free-space probe says


@functools.cache
def mount_namespace() -> list[str] | None:
    """The unshare prefix that can mount a tmpfs here, or None (always None with FAULT_NO_MOUNTS=1)."""
    if os.environ.get("FAULT_NO_MOUNTS") == "1" or not shutil.which("unshare"):
        return None
    for prefix in (["unshare", "--mount", "--propagation", "private"],
                   ["unshare", "--map-root-user", "--mount", "--propagation", "private"]):
        probe = subprocess.run([*prefix, "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt 2>/dev/null || "
                                "mount -t tmpfs -o size=4k tmpfs /tmp"], capture_output=True)
        if probe.returncode == 0:
            return prefix
    return None


def private_mounts(mounts: dict[str, str], command: list[str]) -> list[str]:
    """`command` run under tmpfs mounts ({folder: "full" | "ro"}) of its own, or under the named double."""
    prefix = mount_namespace()
    if prefix is None:
        return double_command(mounts, command)
    script = " && ".join(f"mkdir -p {shlex.quote(folder)} && mount -t tmpfs -o {OPTIONS[kind]} tmpfs "
                         f"{shlex.quote(folder)}" for folder, kind in mounts.items())
    return [*prefix, "sh", "-c", f"{script} && exec {shlex.join(command)}"]


def double_command(mounts: dict[str, str], command: list[str]) -> list[str]:
    """`command` (``python -m harness ...``) with the doubles installed first, in the same interpreter."""
    assert command[1:3] == ["-m", "harness"], command
    code = (f"import sys; from tests.support import fault_storage as storage; storage.install({mounts!r}); "
            f"from harness.cli import main; sys.argv = {['harness', *command[3:]]!r}; raise SystemExit(main())")
    return [command[0], "-c", code]


class _WriteBoundaryDouble:
    """Every write under `folder` fails with `code`: os.open/open for writing, mkdir, safetensors' writer."""

    def __init__(self, folder: str, code: int):
        self.folder, self.code = os.path.realpath(folder), code

    def covers(self, path) -> bool:
        try:
            real = os.path.realpath(os.fspath(path))
        except TypeError:
            return False
        return real == self.folder or real.startswith(self.folder + os.sep)

    def fail(self, path):
        raise OSError(self.code, os.strerror(self.code), os.fspath(path))


class FullDiskDouble(_WriteBoundaryDouble):
    def __init__(self, folder: str):
        super().__init__(folder, errno.ENOSPC)


class ReadOnlyDouble(_WriteBoundaryDouble):
    def __init__(self, folder: str):
        super().__init__(folder, errno.EROFS)


def install(mounts: dict[str, str]) -> None:
    """Patch the write boundary for each folder (the fallback of ``private_mounts``)."""
    import builtins
    import io

    import safetensors.numpy

    doubles = [(FullDiskDouble if kind == "full" else ReadOnlyDouble)(folder) for folder, kind in mounts.items()]

    def guard(path, writing=True):
        for double in doubles:
            if writing and double.covers(path):
                double.fail(path)

    real_open, real_mkdir, real_os_open, real_save = builtins.open, os.mkdir, os.open, safetensors.numpy.save_file

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, bytes, os.PathLike)):
            guard(file, any(flag in mode for flag in "wax+"))
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        guard(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        guard(path, bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        return real_os_open(path, flags, *args, **kwargs)

    def fake_save(tensors, filename, *args, **kwargs):
        guard(filename)
        return real_save(tensors, filename, *args, **kwargs)

    from harness import resources

    real_free_disk = resources.free_disk

    def fake_free_disk(folder):  # the disk budget's probe (harness.pipeline.disk_budget): the tmpfs's free space
        full = [double for double in doubles if isinstance(double, FullDiskDouble) and double.covers(folder)]
        return (FULL_FREE, hash(full[0].folder)) if full else real_free_disk(folder)

    builtins.open = io.open = fake_open
    os.mkdir, os.open, safetensors.numpy.save_file = fake_mkdir, fake_os_open, fake_save
    resources.free_disk = fake_free_disk


if __name__ == "__main__":
    print(mount_namespace() or "no mount namespace: the named doubles stand in", file=sys.stderr)
