"""The comparator's statistics on tensors built to have known differences."""

import ml_dtypes
import numpy as np
import pytest

from harness.compare.tensors import DIFF, DTYPE_MISMATCH, EQUAL, MISSING, SHAPE_MISMATCH, compare_tensor, ulp_histogram

BF16 = ml_dtypes.bfloat16


def flip(array, index, bit):
    out = array.copy()
    out.view(np.uint16 if out.itemsize == 2 else np.uint32)[index] ^= 1 << bit
    return out


@pytest.fixture
def tensor():
    return np.random.default_rng(0).standard_normal((64, 32)).astype(BF16)


def test_equal_tensors(tensor):
    result = compare_tensor("t", tensor, tensor.copy())
    assert result.status == EQUAL and result.mismatches == 0 and result.first_mismatch is None


def test_one_flipped_low_bit_is_one_ulp_at_its_index(tensor):
    result = compare_tensor("t", flip(tensor, (5, 7), 0), tensor)
    assert result.status == DIFF
    assert (result.mismatches, result.max_ulp, result.p99_ulp) == (1, 1, 1)
    assert result.first_mismatch["index"] == [5, 7]
    assert result.ulp_histogram == {"1": 1}
    assert result.mismatch_share == pytest.approx(1 / tensor.size)
    assert result.max_abs_error == pytest.approx(abs(float(tensor[5, 7])) * 2**-7, rel=0.5)


def test_signed_zero_and_nan_payload_are_counted_apart():
    a = np.array([0.0, 1.0, np.nan, 2.0], dtype=np.float32)
    b = np.array([-0.0, 1.0, np.nan, 2.0], dtype=np.float32)
    b.view(np.uint32)[2] |= 1  # another NaN payload
    result = compare_tensor("t", a, b)
    assert (result.mismatches, result.signed_zero_diffs, result.nan_payload_diffs) == (2, 1, 1)
    assert result.max_ulp == 0 and result.ulp_histogram == {}


def test_sign_flip_near_zero_has_huge_raw_ulp_but_small_scaled_error():
    a = np.array([-1.19e-7, 3.0, -2.0], dtype=BF16)
    b = np.array([2.16e-7, 3.0, -2.0], dtype=BF16)
    result = compare_tensor("t", a, b)
    assert result.sign_flips == 1
    assert result.max_ulp > 20_000
    assert result.scale == 3.0
    assert result.max_error_in_scale_ulps < 0.01  # tiny against the spacing at 3.0 (2**-6)


def test_nan_against_number_is_a_nan_mismatch():
    result = compare_tensor("t", np.array([np.nan, 1.0], np.float32), np.array([0.5, 1.0], np.float32))
    assert result.nan_mismatches == 1 and result.mismatches == 1 and result.max_ulp == 0


def test_structural_problems_are_named():
    x = np.zeros((2, 3), np.float32)
    assert compare_tensor("t", x, np.zeros((3, 2), np.float32)).status == SHAPE_MISMATCH
    assert compare_tensor("t", x, x.astype(BF16)).status == DTYPE_MISMATCH
    assert compare_tensor("t", None, x).status == MISSING


def test_histogram_buckets_are_inclusive_power_of_two_ranges():
    ulps = np.array([1, 1, 2, 3, 4, 5, 8, 9, 1024, 1025], dtype=np.uint64)
    assert ulp_histogram(ulps) == {"1": 2, "2": 1, "3-4": 2, "5-8": 2, "9-16": 1, "513-1024": 1, "1025-2048": 1}
