"""What a cell changes in its process ends with the cell: the building blocks (standard library only).

A worker (``harness.run.workers``) serves many cells in one process, and its bytes must be a fresh process's bytes.
So every process-wide setting a runner changes for one cell (a patched function, a default dtype, a flag, an
environment variable, a random state) is put back when the cell ends, in ``finally``. ``protocol.run_cell`` does it
for every runner: ``os.environ`` (``environment_restored``) and every ``patch`` a runner made in the cell
(``patches_undone``); each framework room adds what its framework keeps in its own state, one ``restored`` per
setting (``harness.runners.torch.env.CELL_STATE``, ``harness.runners.paddle.state``), passed to ``serve`` as
``cell_state``. ``tests/test_worker_state.py`` proves it: a worker serving a mixed sequence of cells writes the
bytes fresh processes write, cell by cell, for every runner.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

_ABSENT = object()
_PATCHED: list[tuple[object, str, object]] = []  # (owner, name, value before): undone in reverse at the cell's end


def patch(owner: object, name: str, value: object) -> None:
    """``owner.name = value`` until the end of the running cell (``patches_undone``): an adapter a runner needs for
    one cell (a CPU stand-in for ``torch.cuda.current_device``, a module flag) never reaches the next one."""
    _PATCHED.append((owner, name, getattr(owner, name, _ABSENT)))
    setattr(owner, name, value)


@contextmanager
def patches_undone() -> Iterator[None]:
    """Every ``patch`` made inside the block undone when it ends (an attribute that did not exist is deleted)."""
    mark = len(_PATCHED)
    try:
        yield
    finally:
        while len(_PATCHED) > mark:
            owner, name, saved = _PATCHED.pop()
            _put_back(owner, name, saved)


def _put_back(owner: object, name: str, saved: object) -> None:
    if saved is _ABSENT:
        if hasattr(owner, name):
            delattr(owner, name)
    else:
        setattr(owner, name, saved)


@contextmanager
def restored(read: Callable[[], object], write: Callable[[object], None]) -> Iterator[None]:
    """`write(read())` after the block: a setting read before the cell is put back, whatever the cell did."""
    saved = read()
    try:
        yield
    finally:
        write(saved)


@contextmanager
def attribute_restored(owner: object, name: str) -> Iterator[None]:
    """``owner.name`` as it was before the block; deleted again if it did not exist (a patch that adds a name)."""
    saved = getattr(owner, name, _ABSENT)
    try:
        yield
    finally:
        _put_back(owner, name, saved)


@contextmanager
def environment_restored() -> Iterator[None]:
    """``os.environ`` as it was before the block: variables a cell set, changed or removed are put back."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for key in [k for k in os.environ if k not in saved]:
            del os.environ[key]
        for key, value in saved.items():
            if os.environ.get(key) != value:
                os.environ[key] = value


@contextmanager
def all_restored(settings: dict[str, Callable[[], object]]) -> Iterator[None]:
    """Every context manager of `settings` (name -> factory, the name saying which setting) entered around the
    block, so each one's ``finally`` runs even when another's fails."""
    with ExitStack() as stack:
        for factory in settings.values():
            stack.enter_context(factory())
        yield
