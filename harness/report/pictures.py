"""PNG pictures of a differing tensor: where its mismatches sit, and how far apart (ULP histogram).

The map uses one fixed colour scale for every tensor: log share of mismatching elements per cell, from
one element per cell up to all of them, with cells free of mismatches left white. So a different
algorithm fills the map with one strong colour, a different tiling or split-K draws solid rectangles on
white, and a different accumulation order sprinkles faint single cells over it. The marginals (share
per row band and per column band, each scaled to its own maximum) show where tile edges line up; when
few cells are touched, each is ringed in red, since one cell may be smaller than a pixel.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display; must precede pyplot
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402

from harness import paths  # noqa: E402
from harness.compare.tensors import TensorComparison  # noqa: E402

RING_CELLS = 400  # at most this many touched cells get a ring drawn around them


def render(tensors: list[TensorComparison], folder: Path) -> dict[str, dict[str, str]]:
    """Writes the pictures of every differing tensor; returns {tensor: {"map": path, "ulp": path}}.

    Paths are relative to folder's parent (the run folder), as report.md and report.html link them."""
    written = {}
    for tensor in tensors:
        if tensor.mismatch_map is None:
            continue
        folder.mkdir(parents=True, exist_ok=True)
        stem = paths.file_stem(tensor.name)  # a dump's tensor name may hold '/' or '..': never leaves the folder
        files = {"map": f"{stem}.map.png", "ulp": f"{stem}.ulp.png"}
        mismatch_map_png(tensor, folder / files["map"])
        ulp_histogram_png(tensor, folder / files["ulp"])
        written[tensor.name] = {kind: f"{folder.name}/{name}" for kind, name in files.items()}
    return written


def mismatch_map_png(tensor: TensorComparison, path: Path) -> None:
    where = tensor.mismatch_map
    share = where.share()
    summary = where.summary()
    cell_h, cell_w = summary["cell_elements"]
    figure = plt.figure(figsize=(9, 7.5), dpi=90)
    grid = figure.add_gridspec(2, 3, width_ratios=[5, 1, 0.18], height_ratios=[1, 4], hspace=0.06, wspace=0.05)
    heat = figure.add_subplot(grid[1, 0])
    top = figure.add_subplot(grid[0, 0], sharex=heat)
    right = figure.add_subplot(grid[1, 1], sharey=heat)
    bar = figure.add_subplot(grid[1, 2])

    colours = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    norm = LogNorm(vmin=1 / max(1, cell_h * cell_w), vmax=1.0)
    image = heat.imshow(np.ma.masked_equal(share, 0), cmap=colours, norm=norm, aspect="auto",
                        interpolation="nearest", extent=(0, where.cols, where.rows, 0))
    heat.set_xlabel(f"column (last dim, {where.cols}); one cell = {cell_h} x {cell_w} elements")
    heat.set_ylabel(f"row ({where.rows})")
    figure.colorbar(image, cax=bar, label="mismatch share per cell (log; white = none)")
    touched = np.argwhere(where.counts > 0)
    if len(touched) <= RING_CELLS:  # isolated cells are smaller than a pixel: ring them
        centre_row = (touched[:, 0] + 0.5) * where.rows / share.shape[0]
        centre_col = (touched[:, 1] + 0.5) * where.cols / share.shape[1]
        heat.scatter(centre_col, centre_row, s=90, facecolors="none", edgecolors="tab:red", linewidths=1.2)

    col_edges = np.linspace(0, where.cols, share.shape[1] + 1)
    row_edges = np.linspace(0, where.rows, share.shape[0] + 1)
    top.stairs(where.col_share(), col_edges, fill=True, color="tab:red")
    top.set_ylim(0, max(where.col_share().max(), 1e-12) * 1.1)
    top.set_ylabel("share\nper column")
    top.tick_params(labelbottom=False)
    right.stairs(where.row_share(), row_edges, orientation="horizontal", fill=True, color="tab:red")
    right.set_xlim(0, max(where.row_share().max(), 1e-12) * 1.1)
    right.set_xlabel("share per row")
    right.tick_params(labelleft=False)
    figure.suptitle(f"{tensor.name} {tensor.dtype}{tensor.shape}: {tensor.mismatches} of {tensor.elements} "
                    f"elements differ ({tensor.mismatch_share:.3%}); "
                    f"{summary['cells_with_mismatches']} of {summary['cells']} cells touched", fontsize=10)
    figure.savefig(path)
    plt.close(figure)


def ulp_histogram_png(tensor: TensorComparison, path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 3.6), dpi=90)
    labels, counts = list(tensor.ulp_histogram), list(tensor.ulp_histogram.values())
    apart = {"±0": tensor.signed_zero_diffs, "NaN": tensor.nan_payload_diffs + tensor.nan_mismatches}
    labels += [k for k, v in apart.items() if v]
    counts += [v for v in apart.values() if v]
    colours = ["tab:blue"] * len(tensor.ulp_histogram) + ["tab:gray"] * (len(labels) - len(tensor.ulp_histogram))
    axes.bar(range(len(labels)), counts, color=colours)
    axes.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
    axes.set_yscale("log")
    axes.set_xlabel("ULP distance (power-of-two buckets; grey: counted apart)")
    axes.set_ylabel("mismatching elements")
    axes.set_title(f"{tensor.name}: max {tensor.max_ulp} ULP, p99 {tensor.p99_ulp} ULP, "
                   f"{tensor.sign_flips} sign flips, max err {tensor.max_error_in_scale_ulps:.3g} ULP at scale",
                   fontsize=9)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
