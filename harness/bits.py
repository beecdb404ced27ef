"""Bit patterns of floating-point formats, and ULP distance computed on them.

Why raw bits: a bitwise verdict must not depend on a float conversion. Every float is mapped to an
integer of its own width; the *ordered* integer is monotone in the float value, so the ULP distance
between two floats is the difference of their ordered integers.

Semantics, chosen on purpose (the same for bfloat16, float16, float32 and float64; checked against
numpy.testing's ``integer_repr``/``nulp_diff``, ``numpy.nextafter`` and, for the 16-bit formats, against
every bit pattern, in tests/test_ulp_semantics.py):
- The mapping is sign-magnitude to two's complement: ``ordered = +magnitude`` for a clear sign bit and
  ``-magnitude`` for a set one, where magnitude is the bits without the sign bit.
- +0 and -0 both map to 0, so they are 0 ULP apart; the comparator counts them apart as signed-zero
  differences. Hence -min_subnormal -> +min_subnormal is 2 ULP (two steps, through zero).
- Subnormals are ordinary steps: the smallest subnormal is 1 ULP from zero, the largest subnormal 1 ULP
  from the smallest normal.
- Infinities sit one step past the largest finite value (they are the next magnitude pattern), so
  max -> inf is 1 ULP and -inf -> +inf is twice the infinity pattern (below 2**64 even for float64).
- NaNs have no place in the order: ``ulp_distance`` of a NaN is unspecified, and callers mask NaNs out
  (see ``is_nan``). Two NaNs with different bits (payload or sign) are a "NaN payload difference",
  counted apart by the comparator; a NaN against a number is a "NaN mismatch".
- Distances are exact integers: uint32 for the 16-bit formats (at most 2 * 0x7f80), uint64 for the
  others (float64's largest, -inf to +inf, is 0xffe0... < 2**64, so it never overflows).
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class FloatFormat:
    name: str
    float_dtype: np.dtype
    bits_dtype: np.dtype  # unsigned integer of the same width
    exponent_bits: int
    mantissa_bits: int

    @property
    def width(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("bfloat16", np.dtype(ml_dtypes.bfloat16), np.dtype(np.uint16), 8, 7),
        FloatFormat("float16", np.dtype(np.float16), np.dtype(np.uint16), 5, 10),
        FloatFormat("float32", np.dtype(np.float32), np.dtype(np.uint32), 8, 23),
        FloatFormat("float64", np.dtype(np.float64), np.dtype(np.uint64), 11, 52),
    )
}


def format_of(dtype: np.dtype | str) -> FloatFormat:
    """The format of a numpy dtype or a dtype name ('bfloat16', 'float32', ...)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unsupported float dtype {name!r}; known: {', '.join(FORMATS)}") from None


def as_bits(values: np.ndarray) -> np.ndarray:
    """A view of a float array as unsigned integers of the same width (no copy, no conversion)."""
    return values.view(format_of(values.dtype).bits_dtype)


def sign_bit(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    return (bits >> (fmt.width - 1)).astype(bool)


def is_nan(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    magnitude = bits & magnitude_mask(fmt)
    return magnitude > infinity_bits(fmt)


def is_zero(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    return (bits & magnitude_mask(fmt)) == 0


def ordered(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Signed integer monotone in the float value; +0 and -0 both map to 0 (int32 for 16-bit formats, else int64)."""
    if fmt.width <= 16:  # in int16, a few cheap passes: negatives -(magnitude) = (s ^ 0x7fff) + 1, never overflowing
        signed = bits.view(np.int16)
        negative = signed >> 15  # 0 or -1
        return ((signed ^ (negative & np.int16(0x7FFF))) - negative).astype(np.int32)
    magnitude = (bits & magnitude_mask(fmt)).astype(np.int64)
    negative = (bits >> (fmt.width - 1)).astype(np.int64)  # 0 or 1
    return (magnitude ^ -negative) + negative  # two's complement negation where the sign bit is set


def ulp_distance(a_bits: np.ndarray, b_bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Number of representable steps between a and b, i.e. |ordered(a) - ordered(b)| (NaNs: unspecified).

    uint32 for the 16-bit formats (from ``ordered``), else uint64, computed from magnitudes without
    forming ordered integers: same signs, the magnitudes' difference; opposite signs, their sum (the steps
    down to zero and up again), which stays below 2**64 even for float64.
    """
    if fmt.width <= 16:
        return np.abs(ordered(a_bits, fmt) - ordered(b_bits, fmt)).view(np.uint32)
    mask = magnitude_mask(fmt)
    magnitude_a, magnitude_b = (a_bits & mask).astype(np.uint64), (b_bits & mask).astype(np.uint64)
    opposite = ((a_bits ^ b_bits) >> (fmt.width - 1)).astype(bool)
    apart = np.maximum(magnitude_a, magnitude_b) - np.minimum(magnitude_a, magnitude_b)
    return np.where(opposite, magnitude_a + magnitude_b, apart)


def spacing_at(magnitude: float, fmt: FloatFormat) -> float:
    """The gap between `magnitude` (finite, >= 0) and the next larger value of the format."""
    value = np.array(magnitude, dtype=np.float64).astype(fmt.float_dtype)
    bits = value.reshape(1).view(fmt.bits_dtype)
    above = (bits + fmt.bits_dtype.type(1)).view(fmt.float_dtype)
    return float(above.astype(np.float64)[0]) - float(value.astype(np.float64))


def magnitude_mask(fmt: FloatFormat):
    return fmt.bits_dtype.type((1 << (fmt.width - 1)) - 1)


def infinity_bits(fmt: FloatFormat):
    return fmt.bits_dtype.type(((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits)
