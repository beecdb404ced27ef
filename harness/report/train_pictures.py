"""The picture of a training run's mismatches along time: one row per quantity (in a step's order), one column per
step, each cell the share of that quantity's tensors whose bits differ (a scalar: 0 or 1); white where all are
equal. A planted bit shows as one faint cell that spreads over the following steps; a formula difference as a
full row from its first step on."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.report.pictures import _pyplot
from harness.report.train_section import label


def steps_matrix_png(train: dict, path: Path) -> None:
    matplotlib, plt, _ = _pyplot()
    steps = train["steps"]
    quantities = [q for q in train["order"] if any(q in s["quantities"] or q in s["scalars"] for s in steps)]
    share = np.zeros((len(quantities), len(steps)))
    for j, s in enumerate(steps):
        for i, q in enumerate(quantities):
            if q in s["scalars"]:
                share[i, j] = 1.0 if s["scalars"][q]["equal"] is False else 0.0  # None: one side computes none
            elif q in s["quantities"]:
                counts = s["quantities"][q]
                share[i, j] = 1 - counts["equal"] / counts["total"]
    figure = plt.figure(figsize=(max(5, 0.35 * len(steps) + 3), 0.45 * len(quantities) + 1.5), dpi=90)
    axes = figure.add_subplot(1, 1, 1)
    colours = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    image = axes.imshow(np.ma.masked_equal(share, 0), cmap=colours, vmin=0, vmax=1, aspect="auto",
                        interpolation="nearest")
    axes.set_yticks(range(len(quantities)), [label(q) for q in quantities])
    ticks = list(range(len(steps))) if len(steps) <= 30 else list(range(0, len(steps), max(1, len(steps) // 20)))
    axes.set_xticks(ticks, [str(steps[t]["step"]) for t in ticks])
    axes.set_xlabel("step")
    figure.colorbar(image, ax=axes, label="share of tensors differing (white: all equal)")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def render(train: dict, folder: Path) -> dict[str, dict[str, str]]:
    """{"train": {"map": path relative to the run folder}}, or {} for a run without steps."""
    if not train or not train.get("steps"):
        return {}
    folder.mkdir(parents=True, exist_ok=True)
    steps_matrix_png(train, folder / "train_steps.png")
    return {"train": {"map": f"{folder.name}/train_steps.png"}}
