"""Ordered-integer mapping and ULP distance, checked against numpy's own float stepping."""

import ml_dtypes
import numpy as np
import pytest

from harness import bits


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_adjacent_values_are_one_ulp_apart(dtype):
    fmt = bits.format_of(np.dtype(dtype))
    x = np.array([-1e3, -1.5, -np.finfo(dtype).tiny, 0.0, np.finfo(dtype).smallest_subnormal, 1.0, 7e2], dtype=dtype)
    up = np.nextafter(x, np.array(np.inf, dtype=dtype))
    d = bits.ulp_distance(bits.as_bits(x), bits.as_bits(up), fmt)
    assert d.tolist() == [1] * len(x), f"distances {d.tolist()} for {x.tolist()} -> {up.tolist()}"


def test_bfloat16_steps_match_ml_dtypes():
    fmt = bits.FORMATS["bfloat16"]
    x = np.array([-3.0, -1e-30, 0.0, 1.0, 123.0], dtype=ml_dtypes.bfloat16)
    up = np.nextafter(x, np.array(np.inf, dtype=ml_dtypes.bfloat16))
    assert bits.ulp_distance(bits.as_bits(x), bits.as_bits(up), fmt).tolist() == [1] * 5


def test_distance_across_zero_counts_both_sides():
    fmt = bits.FORMATS["float32"]
    a = np.array([-np.finfo(np.float32).smallest_subnormal * 3], dtype=np.float32)
    b = np.array([np.finfo(np.float32).smallest_subnormal * 2], dtype=np.float32)
    assert bits.ulp_distance(bits.as_bits(a), bits.as_bits(b), fmt).tolist() == [5]


def test_signed_zeros_are_zero_apart_and_nan_is_detected():
    fmt = bits.FORMATS["bfloat16"]
    zeros = np.array([0.0, -0.0], dtype=ml_dtypes.bfloat16)
    assert bits.ulp_distance(bits.as_bits(zeros[:1]), bits.as_bits(zeros[1:]), fmt).tolist() == [0]
    values = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=ml_dtypes.bfloat16)
    assert bits.is_nan(bits.as_bits(values), fmt).tolist() == [True, False, False, False]


def test_float64_extremes_do_not_overflow():
    fmt = bits.FORMATS["float64"]
    a, b = np.array([-np.inf]), np.array([np.inf])
    expected = 2 * int(bits.as_bits(b)[0])
    assert int(bits.ulp_distance(bits.as_bits(a), bits.as_bits(b), fmt)[0]) == expected


def test_spacing_at_matches_numpy():
    for value in (1.0, 3.7, 1000.0):
        assert bits.spacing_at(value, bits.FORMATS["float32"]) == float(np.spacing(np.float32(value)))
    assert bits.spacing_at(1.0, bits.FORMATS["bfloat16"]) == 2.0**-7
