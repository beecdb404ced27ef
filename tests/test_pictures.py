"""The mismatch map tells the three kinds of GEMM difference apart (see tests/support/gemm_patterns.py).

Checked on the map's numbers (what the picture draws), and the PNGs are written and readable. To look at
them: `python -m pytest tests/test_pictures.py --basetemp=/tmp/pictures` and open /tmp/pictures/*/*.png.
"""

import numpy as np
import pytest

from harness.compare.tensors import compare_tensor
from harness.report import pictures
from tests.support import gemm_patterns as g


@pytest.fixture(scope="module")
def gemm():
    x, w = g.operands()
    return x, w, g.reference(x, w)


def compared(gemm, kind):
    x, w, reference = gemm
    return compare_tensor(kind, getattr(g, kind)(x, w), reference)


def test_flipped_bit_touches_one_cell(gemm):
    summary = compared(gemm, "flipped_bit").mismatch_map.summary()
    assert summary["cells_with_mismatches"] == 1
    assert summary["bounding_box_elements"]["rows"][0] <= 300 <= summary["bounding_box_elements"]["rows"][1]


def test_different_recipe_touches_nearly_every_cell(gemm):
    where = compared(gemm, "bf16_accumulation").mismatch_map
    assert where.summary()["cells_with_mismatches"] > 0.95 * where.counts.size
    assert where.row_share().min() > 0.5 and where.col_share().min() > 0.5


def test_split_k_tiles_fill_their_tiles_and_nothing_else(gemm):
    where = compared(gemm, "split_k_tiles").mismatch_map
    inside = np.zeros((512, 768), bool)
    for rows, cols in g.TILES:
        inside[rows, cols] = True
    cells = inside.reshape(256, 2, 256, 3)  # one cell = 2 x 3 elements; tile edges may cut a cell
    share = where.share()
    assert share[~cells.any(axis=(1, 3))].max() == 0
    assert (share[cells.all(axis=(1, 3))] > 0).mean() > 0.8  # solid: most cells of a tile are touched


def test_accumulation_order_is_sparse_and_scattered(gemm):
    where = compared(gemm, "fp32_split_k").mismatch_map
    touched = np.argwhere(where.counts > 0)
    assert 0 < len(touched) < 0.01 * where.counts.size
    assert np.ptp(touched[:, 0]) > 128 and np.ptp(touched[:, 1]) > 128  # spread over the tensor, not a block


def test_pngs_are_written_for_differing_tensors_only(gemm, tmp_path):
    x, w, reference = gemm
    tensors = [compared(gemm, kind) for kind in ("flipped_bit", "bf16_accumulation", "split_k_tiles")]
    tensors.append(compare_tensor("same", reference, reference.copy()))
    written = pictures.render(tensors, tmp_path / "pictures")
    assert set(written) == {"flipped_bit", "bf16_accumulation", "split_k_tiles"}
    for files in written.values():
        for relative in files.values():
            assert (tmp_path / relative).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
