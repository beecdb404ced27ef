"""Per-tensor comparison on raw bit patterns (numpy + ml_dtypes only, no framework).

Equality is decided on bits. Statistics are computed over the mismatching elements only, so a
bitwise-equal tensor costs one pass. Conventions (documented in the README):
- ``ulp``: distance between ordered integers (see ``harness.bits``); NaN pairs and +0/-0 pairs are
  counted apart and excluded from ULP statistics.
- ``p99_ulp``: 99th percentile over the *mismatching* numeric elements.
- ``sign_flips``: mismatching pairs of nonzero values with opposite signs.
- ``max_rel_error``: over elements whose reference (side B) value is nonzero.
- ``scale`` is the tensor's largest finite magnitude (side B) and ``max_error_in_scale_ulps`` the
  largest absolute error divided by the format's spacing at that scale: below 1 means the
  difference is under the resolution of the tensor's largest values, whatever the raw ULP count near zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from harness import bits

EQUAL, DIFF, SHAPE_MISMATCH, DTYPE_MISMATCH, MISSING = "EQUAL", "DIFF", "SHAPE_MISMATCH", "DTYPE_MISMATCH", "MISSING"


@dataclass
class TensorComparison:
    name: str
    status: str
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    elements: int = 0
    mismatches: int = 0
    mismatch_share: float = 0.0
    signed_zero_diffs: int = 0
    nan_payload_diffs: int = 0
    nan_mismatches: int = 0
    sign_flips: int = 0
    max_ulp: int = 0
    p99_ulp: int = 0
    ulp_histogram: dict[str, int] = field(default_factory=dict)
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    scale: float = 0.0
    max_error_in_scale_ulps: float = 0.0
    first_mismatch: dict | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def compare_tensor(name: str, a: np.ndarray | None, b: np.ndarray | None) -> TensorComparison:
    """Compare side A's tensor with side B's (B is the reference for relative error and scale)."""
    if a is None or b is None:
        return TensorComparison(name, MISSING, note=f"missing on side {'A' if a is None else 'B'}")
    if a.dtype != b.dtype:
        return TensorComparison(name, DTYPE_MISMATCH, note=f"dtype {a.dtype.name} vs {b.dtype.name}")
    if a.shape != b.shape:
        return TensorComparison(name, SHAPE_MISMATCH, dtype=a.dtype.name,
                                note=f"shape {list(a.shape)} vs {list(b.shape)}")
    if a.dtype.kind in "iu":
        return _compare_integers(name, a, b)
    fmt = bits.format_of(a.dtype)
    a_bits, b_bits = bits.as_bits(np.ascontiguousarray(a)).ravel(), bits.as_bits(np.ascontiguousarray(b)).ravel()
    result = TensorComparison(name, EQUAL, dtype=fmt.name, shape=list(a.shape), elements=int(a.size))
    where = np.flatnonzero(a_bits != b_bits)
    if where.size == 0:
        return result
    result.status = DIFF
    result.mismatches = int(where.size)
    result.mismatch_share = where.size / a.size
    ab, bb = a_bits[where], b_bits[where]
    result.first_mismatch = _describe_element(a.shape, int(where[0]), ab[0], bb[0], fmt)

    nan_a, nan_b = bits.is_nan(ab, fmt), bits.is_nan(bb, fmt)
    result.nan_payload_diffs = int(np.count_nonzero(nan_a & nan_b))
    result.nan_mismatches = int(np.count_nonzero(nan_a ^ nan_b))
    zero_a, zero_b = bits.is_zero(ab, fmt), bits.is_zero(bb, fmt)
    result.signed_zero_diffs = int(np.count_nonzero(zero_a & zero_b))
    numeric = ~(nan_a | nan_b) & ~(zero_a & zero_b)
    ab, bb = ab[numeric], bb[numeric]
    if ab.size == 0:
        return result
    nonzero = ~bits.is_zero(ab, fmt) & ~bits.is_zero(bb, fmt)
    result.sign_flips = int(np.count_nonzero(nonzero & (bits.sign_bit(ab, fmt) != bits.sign_bit(bb, fmt))))

    ulps = bits.ulp_distance(ab, bb, fmt)
    result.max_ulp = int(ulps.max())
    k = int(np.ceil(0.99 * ulps.size)) - 1
    result.p99_ulp = int(np.partition(ulps, k)[k])
    result.ulp_histogram = ulp_histogram(ulps)

    av, bv = _as_float64(ab, fmt), _as_float64(bb, fmt)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        error = np.abs(av - bv)
        result.max_abs_error = float(np.max(error))
        reference = np.abs(bv)
        result.max_rel_error = float(np.max(error[reference > 0] / reference[reference > 0], initial=0.0))
        result.scale = _largest_finite_magnitude(b_bits, fmt)
        spacing = bits.spacing_at(result.scale, fmt)
        result.max_error_in_scale_ulps = float(result.max_abs_error / spacing)
    return result


def _compare_integers(name: str, a: np.ndarray, b: np.ndarray) -> TensorComparison:
    """Integer outputs (top-k expert indices): equal or not per element; ULP statistics do not apply."""
    result = TensorComparison(name, EQUAL, dtype=a.dtype.name, shape=list(a.shape), elements=int(a.size))
    where = np.flatnonzero(a.ravel() != b.ravel())
    if where.size:
        index = [int(i) for i in np.unravel_index(int(where[0]), a.shape)]
        result.status, result.mismatches, result.mismatch_share = DIFF, int(where.size), where.size / a.size
        result.first_mismatch = {"index": index, "a": int(a.ravel()[where[0]]), "b": int(b.ravel()[where[0]]),
                                 "a_bits": str(a.ravel()[where[0]]), "b_bits": str(b.ravel()[where[0]])}
        result.note = "integer tensor: mismatches counted, no ULP statistics"
    return result


def ulp_histogram(ulps: np.ndarray) -> dict[str, int]:
    """Counts in power-of-two buckets: '1', '2', '3-4', '5-8', ... (labels name the inclusive range)."""
    _, exponent = np.frexp((ulps - 1).astype(np.float64))  # bit length of (d - 1): d=1 -> 0, d=2 -> 1, 3..4 -> 2
    counts = np.bincount(exponent.astype(np.int64))
    histogram = {}
    for k, count in enumerate(counts):
        if count:
            low, high = (1, 1) if k == 0 else (2 ** (k - 1) + 1, 2**k)
            histogram[str(low) if low == high else f"{low}-{high}"] = int(count)
    return histogram


def _describe_element(shape, flat_index: int, a_bits, b_bits, fmt) -> dict:
    width = fmt.width // 4
    return {
        "index": [int(i) for i in np.unravel_index(flat_index, shape)],
        "a": float(_as_float64(np.array([a_bits]), fmt)[0]),
        "b": float(_as_float64(np.array([b_bits]), fmt)[0]),
        "a_bits": f"0x{int(a_bits):0{width}x}",
        "b_bits": f"0x{int(b_bits):0{width}x}",
    }


def _as_float64(raw_bits: np.ndarray, fmt: bits.FloatFormat) -> np.ndarray:
    return raw_bits.astype(fmt.bits_dtype).view(fmt.float_dtype).astype(np.float64)


def _largest_finite_magnitude(raw_bits: np.ndarray, fmt: bits.FloatFormat) -> float:
    magnitude = raw_bits & bits.magnitude_mask(fmt)
    finite = magnitude[magnitude < bits.infinity_bits(fmt)]
    if finite.size == 0:
        return 0.0
    return float(_as_float64(np.array([finite.max()]), fmt)[0])
