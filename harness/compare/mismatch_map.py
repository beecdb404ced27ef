"""Where mismatches sit: counts binned onto a coarse 2-D grid over the tensor, filled chunk by chunk.

Why a grid: GEMM kernels work in tiles, so a different tiling or split-K changes whole rectangles, a
different algorithm changes nearly every cell, and a different accumulation order leaves isolated
elements. Binning to at most ``MAX_CELLS`` per axis keeps the map small for any tensor while a cell
(e.g. 16 x 28 elements of a 4096 x 7168 weight) stays finer than the usual 64..256-wide GEMM tiles.
A tensor of rank > 2 is seen as (product of leading dims) x (last dim); rank 0 and 1 as one row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MAX_CELLS = 256


@dataclass
class MismatchMap:
    rows: int
    cols: int
    counts: np.ndarray = field(repr=False)  # int64 [grid_rows, grid_cols]: mismatching elements per cell

    @classmethod
    def for_shape(cls, shape: tuple[int, ...], max_cells: int = MAX_CELLS) -> MismatchMap:
        cols = int(shape[-1]) if len(shape) else 1
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        grid = (max(1, min(rows, max_cells)), max(1, min(cols, max_cells)))
        return cls(rows, cols, np.zeros(grid, dtype=np.int64))

    def add_mask(self, offset: int, differ: np.ndarray, count: int) -> None:
        """Count the mismatches of one chunk (a bool mask starting at flat `offset`).

        Dense chunks that hold whole rows are summed row-wise (one pass over the mask); sparse ones by index.
        """
        whole_rows = offset % self.cols == 0 and differ.size % self.cols == 0
        if not whole_rows or count * 32 < differ.size:
            self.add(np.flatnonzero(differ) + offset)
            return
        grid_rows, grid_cols = self.counts.shape
        col_starts = _first(np.arange(grid_cols), self.cols, grid_cols)
        per_row = np.add.reduceat(differ.reshape(-1, self.cols).view(np.uint8), col_starts, axis=1, dtype=np.int64)
        row_cells = np.arange(offset // self.cols, offset // self.cols + per_row.shape[0]) * grid_rows // self.rows
        starts = np.flatnonzero(np.diff(row_cells, prepend=-1))
        self.counts[row_cells[starts]] += np.add.reduceat(per_row, starts, axis=0)

    def add(self, flat_indices: np.ndarray) -> None:
        """Count mismatches given by their flat (row-major) indices into the tensor."""
        grid_rows, grid_cols = self.counts.shape
        row, col = np.divmod(flat_indices.astype(np.int64), self.cols)
        cell = (row * grid_rows // self.rows) * grid_cols + col * grid_cols // self.cols
        self.counts += np.bincount(cell, minlength=grid_rows * grid_cols).reshape(self.counts.shape)

    def elements_per_cell(self) -> np.ndarray:
        rows = np.bincount(np.arange(self.rows) * self.counts.shape[0] // self.rows)
        cols = np.bincount(np.arange(self.cols) * self.counts.shape[1] // self.cols)
        return np.outer(rows, cols)

    def share(self) -> np.ndarray:
        """Mismatch share per cell (0..1)."""
        return self.counts / self.elements_per_cell()

    def row_share(self) -> np.ndarray:
        return self.counts.sum(axis=1) / self.elements_per_cell().sum(axis=1)

    def col_share(self) -> np.ndarray:
        return self.counts.sum(axis=0) / self.elements_per_cell().sum(axis=0)

    def summary(self) -> dict:
        """A few numbers a reader of report.json can use without the picture."""
        hit = np.argwhere(self.counts > 0)
        grid_rows, grid_cols = self.counts.shape
        summary = {"view": [self.rows, self.cols], "grid": [grid_rows, grid_cols],
                   "cell_elements": [-(-self.rows // grid_rows), -(-self.cols // grid_cols)],
                   "cells_with_mismatches": int(len(hit)), "cells": grid_rows * grid_cols}
        if len(hit):
            (r0, c0), (r1, c1) = hit.min(axis=0), hit.max(axis=0)
            summary["bounding_box_elements"] = {  # first and last element row / column those cells cover
                "rows": [_first(int(r0), self.rows, grid_rows), _first(int(r1) + 1, self.rows, grid_rows) - 1],
                "cols": [_first(int(c0), self.cols, grid_cols), _first(int(c1) + 1, self.cols, grid_cols) - 1]}
        return summary


def _first(cell, size: int, cells: int):
    """First element index of a cell: the smallest i with i * cells // size == cell."""
    return -(-cell * size // cells)
