"""The chunked comparator gives the same numbers as a one-shot computation over the whole tensor."""

import ml_dtypes
import numpy as np
import pytest

from harness import bits
from harness.compare.mismatch_map import MismatchMap
from harness.compare.tensors import bits_equal, compare_tensor

DTYPES = [ml_dtypes.bfloat16, np.float16, np.float32, np.float64]


def perturbed(dtype, shape=(37, 53), seed=0, far=False):
    """A tensor and a copy with scattered small changes, a few sign flips, and (far=True) huge ULP jumps."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(dtype)
    fmt = bits.format_of(a.dtype)
    b = a.copy()
    raw = b.reshape(-1).view(fmt.bits_dtype)
    hit = rng.choice(raw.size, raw.size // 5, replace=False)
    raw[hit] ^= rng.integers(1, 4, hit.size).astype(fmt.bits_dtype)
    raw[hit[:7]] ^= fmt.bits_dtype.type(1 << (fmt.width - 1))  # sign flips
    if far:  # more than 1% of distances beyond 2**16 ULP: p99 needs the rescans
        raw[hit[7:200]] ^= fmt.bits_dtype.type(1 << (fmt.width - 3))
    return a, b


# (16-bit distances never reach 2**16, so only the wide formats take the rescan path)
CASES = [(d, False) for d in DTYPES] + [(np.float32, True), (np.float64, True)]


@pytest.mark.parametrize(("dtype", "far"), CASES, ids=lambda v: np.dtype(v).name if not isinstance(v, bool) else
                         ("far" if v else "near"))
def test_chunk_size_does_not_change_any_number(dtype, far):
    a, b = perturbed(dtype, far=far)
    whole = compare_tensor("t", a, b).to_dict()
    for chunk in (7, 64, 1000):
        assert compare_tensor("t", a, b, chunk_elements=chunk).to_dict() == whole, f"chunk {chunk}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("far", [False, True])
def test_p99_and_max_equal_a_full_sort(dtype, far):
    a, b = perturbed(dtype, far=far, seed=3)
    fmt = bits.format_of(a.dtype)
    ab, bb = bits.as_bits(a).ravel(), bits.as_bits(b).ravel()
    differ = ab != bb
    ulps = np.sort(bits.ulp_distance(ab[differ], bb[differ], fmt).astype(np.uint64))
    result = compare_tensor("t", a, b, chunk_elements=100)
    assert result.p99_ulp == int(ulps[int(np.ceil(0.99 * ulps.size)) - 1])
    assert result.max_ulp == int(ulps[-1])
    assert sum(result.ulp_histogram.values()) == ulps.size == result.mismatches


def test_first_mismatch_and_map_come_from_the_right_chunk():
    a = np.zeros((40, 300), np.float32)
    b = a.copy()
    b[33, 250] = 1.0
    b[39, 299] = 2.0
    result = compare_tensor("t", a, b, chunk_elements=1000)
    assert result.first_mismatch["index"] == [33, 250]
    assert result.mismatch_map.counts.sum() == 2
    assert result.to_dict()["mismatch_map"]["bounding_box_elements"] == {"rows": [33, 39], "cols": [250, 299]}


def test_map_shares_and_cell_sizes():
    where = MismatchMap.for_shape((3, 1000, 10), max_cells=256)
    assert where.counts.shape == (256, 10)
    assert where.elements_per_cell().sum() == 30_000
    where.add(np.arange(30_000))
    assert np.all(where.share() == 1.0) and np.all(where.row_share() == 1.0)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 61])
def test_bits_equal_sees_a_difference_anywhere(size):
    a = np.arange(size, dtype=np.uint16)
    assert bits_equal(a, a.copy(), chunk_elements=5)
    for i in range(size):
        b = a.copy()
        b[i] ^= 1
        assert not bits_equal(a, b, chunk_elements=5), i


def test_dense_row_wise_and_sparse_map_paths_count_the_same():
    differ = np.random.default_rng(4).random((37, 53)) < 0.5
    sparse, dense = MismatchMap.for_shape((37, 53), max_cells=8), MismatchMap.for_shape((37, 53), max_cells=8)
    sparse.add(np.flatnonzero(differ))
    for first_row in range(0, 37, 5):
        part = differ[first_row:first_row + 5].ravel()
        dense.add_mask(first_row * 53, part, int(part.sum()))
    assert np.array_equal(sparse.counts, dense.counts) and dense.counts.sum() == differ.sum()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_threads_sum_what_one_pass_sums(dtype):
    """A tensor of many chunks is summed by several threads and merged; every total equals one pass in order's,
    with NaNs, infinities, signed zeros and a first mismatch only in the last thread's chunks."""
    from harness.compare.tensors import _chunk_totals

    a, b = perturbed(dtype, shape=(61, 47), seed=3)
    fmt = bits.format_of(a.dtype)
    raw_a, raw_b = (x.reshape(-1).view(fmt.bits_dtype) for x in (a, b))
    raw_b[:2000] = raw_a[:2000]  # the first 2,000 elements equal: the first mismatch lies in a later run
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0], dtype=np.float64).astype(a.dtype)
    raw_a[2100:2105] = specials.view(fmt.bits_dtype)
    raw_b[2100:2105] = specials[::-1].view(fmt.bits_dtype)
    raw_a[2200], raw_b[2200] = fmt.bits_dtype.type(0), fmt.bits_dtype.type(1 << (fmt.width - 1))  # +0 and -0
    chunks = [slice(s, s + 40) for s in range(0, raw_a.size, 40)]
    one = _chunk_totals(fmt, a.shape, raw_a, raw_b, chunks, threads=1)
    for threads in (2, 5, 16):
        many = _chunk_totals(fmt, a.shape, raw_a, raw_b, chunks, threads=threads)
        for name, value in vars(one).items():
            other = getattr(many, name)
            if isinstance(value, MismatchMap):
                assert np.array_equal(value.counts, other.counts), (threads, name)
            elif isinstance(value, np.ndarray):
                assert np.array_equal(value, other), (threads, name)
            else:
                assert value == other, (threads, name, value, other)
    assert one.first[0] >= 2000 and one.nan_mismatches and one.signed_zero_diffs
