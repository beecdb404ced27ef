"""Per-tensor comparison on raw bit patterns (numpy + ml_dtypes only, no framework).

Equality is decided on bits. Statistics are computed over the mismatching elements only, so a
bitwise-equal tensor costs one pass. Conventions (documented in the README):
- ``ulp``: distance between ordered integers (see ``harness.bits``); NaN pairs and +0/-0 pairs are
  counted apart and excluded from ULP statistics.
- ``p99_ulp``: 99th percentile (nearest rank) over the *mismatching* numeric elements.
- ``sign_flips``: mismatching pairs of nonzero values with opposite signs.
- ``max_rel_error``: over elements whose reference (side B) value is nonzero.
- ``max_abs_error``/``max_rel_error`` are computed in float64, for bf16 and fp16 in float32 (their values are
  exact there; a difference may round, by at most 2**-24 relative, invisible at the 3 digits reported).
- ``digests``: each side's XXH3-128 of the tensor's raw bytes (``harness.run.steps.digest``), side A first: what a
  baseline's record pins each side's bits with (equal counts may still be other bits).
- ``scale`` is the tensor's largest finite magnitude (side B) and ``max_error_in_scale_ulps`` the
  largest absolute error divided by the format's spacing at that scale: below 1 means the
  difference is under the resolution of the tensor's largest values, whatever the raw ULP count near zero.

Large tensors: the comparator streams over the flat bit arrays in chunks of ``CHUNK_ELEMENTS`` and only
accumulates counts, so its own memory is a few chunk-sized temporaries on top of the two tensors. p99 is
exact, without keeping the distances: an exact count per ULP value below 2**16 is accumulated on the way;
only when the p99 rank lies beyond 2**16 ULP (rare: wide formats far apart) the chunks are scanned again,
each scan narrowing the window by a factor 2**16 (at most four scans for float64).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from harness import bits
from harness.compare.mismatch_map import MismatchMap
from harness.run.steps import digest

EQUAL, DIFF, SHAPE_MISMATCH, DTYPE_MISMATCH, MISSING = "EQUAL", "DIFF", "SHAPE_MISMATCH", "DTYPE_MISMATCH", "MISSING"
CHUNK_ELEMENTS = 2**20  # temporaries of a few MB: measured faster than 8M-element chunks (make bench)
FINE_ULPS = 2**16  # ULP values below this are counted exactly, one bin each
PARALLEL_MIN_CHUNKS = 4  # chunks a thread takes at least: smaller tensors are summed in one pass, no threads


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
    digests: list[str] = field(default_factory=list)
    mismatch_map: MismatchMap | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["mismatch_map"] = self.mismatch_map.summary() if self.mismatch_map else None
        return data


def compare_tensor(name: str, a: np.ndarray | None, b: np.ndarray | None,
                   chunk_elements: int = CHUNK_ELEMENTS) -> TensorComparison:
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
    result = TensorComparison(name, EQUAL, dtype=fmt.name, shape=list(a.shape), elements=int(a.size),
                              digests=[digest(a_bits.view(np.uint8)), digest(b_bits.view(np.uint8))])
    if bits_equal(a_bits, b_bits, chunk_elements):
        return result
    cols = a.shape[-1] if a.ndim else 1
    if 0 < cols <= chunk_elements:  # chunks of whole rows let the mismatch map sum dense chunks row-wise
        chunk_elements = chunk_elements // cols * cols
    chunks = [slice(start, start + chunk_elements) for start in range(0, a_bits.size, chunk_elements)]
    totals = _chunk_totals(fmt, a.shape, a_bits, b_bits, chunks)
    result.status, result.mismatch_map = DIFF, totals.where
    result.mismatches, result.mismatch_share = totals.mismatches, totals.mismatches / a.size
    result.first_mismatch = _describe_element(a.shape, *totals.first, fmt) if totals.first else None
    result.nan_payload_diffs, result.nan_mismatches = totals.nan_payload_diffs, totals.nan_mismatches
    result.signed_zero_diffs, result.sign_flips = totals.signed_zero_diffs, totals.sign_flips
    if totals.numeric == 0:
        return result
    result.max_ulp = totals.max_ulp
    result.p99_ulp = _rank_value(int(np.ceil(0.99 * totals.numeric)) - 1, totals.fine,
                                 lambda: (_numeric_ulps(a_bits[c], b_bits[c], fmt) for c in chunks))
    result.ulp_histogram = totals.histogram()
    result.max_abs_error, result.max_rel_error = totals.max_abs_error, totals.max_rel_error
    result.scale = max(_largest_finite_magnitude(b_bits[c], fmt) for c in chunks)
    with np.errstate(divide="ignore", invalid="ignore"):
        result.max_error_in_scale_ulps = float(np.float64(result.max_abs_error) / bits.spacing_at(result.scale, fmt))
    return result


def _chunk_totals(fmt: bits.FloatFormat, shape, a_bits: np.ndarray, b_bits: np.ndarray, chunks: list[slice],
                  threads: int | None = None) -> _Totals:
    """The chunks' running sums; a tensor of many chunks is cut into `threads` runs of consecutive chunks summed at
    once (numpy releases the GIL) and merged: every total is a count, a sum of counts, a maximum or the first
    mismatch, so the merge gives what one pass in order gives, bit for bit. Why: the largest tensor of a model's dump
    (a 1.2 G-element output-layer gradient at Kimi-K2's widths) took one thread about 20 s, the tail of the whole
    comparison."""
    threads = min(threads or os.cpu_count() or 1, len(chunks) // PARALLEL_MIN_CHUNKS or 1)
    runs = [chunks[len(chunks) * k // threads:len(chunks) * (k + 1) // threads] for k in range(threads)]

    def run_totals(run: list[slice]) -> _Totals:
        totals = _Totals(fmt, MismatchMap.for_shape(shape))
        for chunk in run:
            totals.add(chunk.start, a_bits[chunk], b_bits[chunk])
        return totals

    if threads == 1:
        return run_totals(chunks)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compare-chunks") as pool:
        parts = list(pool.map(run_totals, runs))
    for part in parts[1:]:
        parts[0].merge(part)
    return parts[0]


def bits_equal(a_bits: np.ndarray, b_bits: np.ndarray, chunk_elements: int = CHUNK_ELEMENTS) -> bool:
    """Byte equality of two flat arrays, compared as uint64 words chunk by chunk (early exit on a difference)."""
    a_bytes, b_bytes = a_bits.view(np.uint8), b_bits.view(np.uint8)
    if a_bytes.size != b_bytes.size:
        return False
    words = a_bytes.size // 8 * 8
    if not np.array_equal(a_bytes[words:], b_bytes[words:]):
        return False
    a_words, b_words = a_bytes[:words].view(np.uint64), b_bytes[:words].view(np.uint64)
    step = max(1, chunk_elements * a_bits.itemsize // 8)
    return all(np.array_equal(a_words[i:i + step], b_words[i:i + step]) for i in range(0, a_words.size, step))


def _compare_integers(name: str, a: np.ndarray, b: np.ndarray) -> TensorComparison:
    """Integer outputs (top-k expert indices): equal or not per element; ULP statistics do not apply."""
    result = TensorComparison(name, EQUAL, dtype=a.dtype.name, shape=list(a.shape), elements=int(a.size),
                              digests=[digest(np.ascontiguousarray(x).view(np.uint8)) for x in (a, b)])
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
    return _bucket_labels(np.bincount(_bit_length(ulps - 1)))


class _Totals:
    """Running sums over the chunks of one tensor."""

    def __init__(self, fmt: bits.FloatFormat, where: MismatchMap):
        self.fmt, self.where = fmt, where
        self.mismatches = self.numeric = self.nan_payload_diffs = self.nan_mismatches = 0
        self.signed_zero_diffs = self.sign_flips = self.max_ulp = 0
        self.max_abs_error = self.max_rel_error = 0.0
        self.first: tuple | None = None  # (flat index, a bits, b bits)
        self.fine = np.zeros(FINE_ULPS + 1, dtype=np.int64)  # last bin: ULP >= FINE_ULPS
        self.buckets = np.zeros(65, dtype=np.int64)  # ULP >= FINE_ULPS, by bit length of (ulp - 1)

    def add(self, offset: int, a_bits: np.ndarray, b_bits: np.ndarray) -> None:
        differ = a_bits != b_bits
        count = int(np.count_nonzero(differ))
        if count == 0:
            return
        if self.first is None:
            first = int(np.argmax(differ))
            self.first = (offset + first, a_bits[first], b_bits[first])
        self.mismatches += count
        self.where.add_mask(offset, differ, count)
        fmt = self.fmt
        if count == differ.size:
            ab, bb = a_bits, b_bits
        else:  # few mismatches: gather by index (one pass over the mask), many: by mask
            picked = np.flatnonzero(differ) if count * 8 < differ.size else differ
            ab, bb = a_bits[picked], b_bits[picked]
        mask, infinity = bits.magnitude_mask(fmt), bits.infinity_bits(fmt)
        magnitude_a, magnitude_b = ab & mask, bb & mask
        nan_a, nan_b = magnitude_a > infinity, magnitude_b > infinity
        zero_a, zero_b = magnitude_a == 0, magnitude_b == 0
        special = nan_a | nan_b | (zero_a & zero_b)
        if special.any():
            self.nan_payload_diffs += int(np.count_nonzero(nan_a & nan_b))
            self.nan_mismatches += int(np.count_nonzero(nan_a ^ nan_b))
            self.signed_zero_diffs += int(np.count_nonzero(zero_a & zero_b))
            keep = ~special
            ab, bb, zero_a, zero_b = ab[keep], bb[keep], zero_a[keep], zero_b[keep]
            if ab.size == 0:
                return
        self.numeric += ab.size
        opposite = bits.sign_bit(ab ^ bb, fmt)
        self.sign_flips += int(np.count_nonzero(opposite & ~(zero_a | zero_b)))

        ulps = bits.ulp_distance(ab, bb, fmt)
        self.max_ulp = max(self.max_ulp, int(ulps.max()))
        if fmt.width <= 16:  # every distance is below FINE_ULPS
            self.fine[:FINE_ULPS] += np.bincount(ulps, minlength=FINE_ULPS)
        else:
            self.fine += np.bincount(np.minimum(ulps, FINE_ULPS).astype(np.intp), minlength=FINE_ULPS + 1)
            far = ulps[ulps >= FINE_ULPS]
            if far.size:
                counts = np.bincount(_bit_length(far - np.uint64(1)))
                self.buckets[:counts.size] += counts

        av, bv = _values(ab, fmt), _values(bb, fmt)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            error = np.abs(av - bv)
            self.max_abs_error = max(self.max_abs_error, float(error.max()))
            reference = np.abs(bv, out=bv)
            relative = np.divide(error, reference, out=av)
            self.max_rel_error = max(self.max_rel_error, float(np.max(relative, where=reference > 0, initial=0.0)))

    def merge(self, later: _Totals) -> None:
        """Fold in the sums of chunks that come after this one's (its first mismatch is kept where it has one)."""
        for count in ("mismatches", "numeric", "nan_payload_diffs", "nan_mismatches", "signed_zero_diffs",
                      "sign_flips"):
            setattr(self, count, getattr(self, count) + getattr(later, count))
        self.max_ulp = max(self.max_ulp, later.max_ulp)
        self.max_abs_error = max(self.max_abs_error, later.max_abs_error)
        self.max_rel_error = max(self.max_rel_error, later.max_rel_error)
        self.first = self.first or later.first
        self.fine += later.fine
        self.buckets += later.buckets
        self.where.counts += later.where.counts

    def histogram(self) -> dict[str, int]:
        """Power-of-two buckets: the fine counts folded by bit length, plus the distances beyond them."""
        folded = np.bincount(_FINE_BUCKETS, weights=self.fine[1:FINE_ULPS], minlength=65).astype(np.int64)
        return _bucket_labels(folded + self.buckets)


def _numeric_ulps(a_bits: np.ndarray, b_bits: np.ndarray, fmt: bits.FloatFormat) -> np.ndarray:
    """ULP distances of one chunk's mismatching pairs, without NaN pairs and +0/-0 pairs (as in _Totals)."""
    where = np.flatnonzero(a_bits != b_bits)
    ab, bb = a_bits[where], b_bits[where]
    keep = ~(bits.is_nan(ab, fmt) | bits.is_nan(bb, fmt) | (bits.is_zero(ab, fmt) & bits.is_zero(bb, fmt)))
    return bits.ulp_distance(ab[keep], bb[keep], fmt)


def _rank_value(rank: int, fine: np.ndarray, rescan) -> int:
    """The value at 0-based `rank` in sorted order, from exact small-value counts; beyond them by rescans.

    `rescan()` yields the distances again chunk by chunk; each rescan counts the values of the current
    window [low, high) in FINE_ULPS sub-bins and keeps the sub-bin holding the rank.
    """
    below = np.cumsum(fine)
    if rank < below[-2]:
        return int(np.searchsorted(below, rank, side="right"))
    rank -= int(below[-2])
    low, high = FINE_ULPS, 2**64
    while high - low > 1:
        step = -(-(high - low) // FINE_ULPS)
        counts = np.zeros(FINE_ULPS, dtype=np.int64)
        for ulps in rescan():
            ulps = ulps.astype(np.uint64)
            inside = ulps[(ulps >= np.uint64(low)) & (ulps <= np.uint64(high - 1))]
            counts += np.bincount(((inside - np.uint64(low)) // np.uint64(step)).astype(np.intp),
                                  minlength=FINE_ULPS)
        cumulative = np.cumsum(counts)
        sub = int(np.searchsorted(cumulative, rank, side="right"))
        rank -= int(cumulative[sub - 1]) if sub else 0
        low, high = low + sub * step, min(high, low + (sub + 1) * step)
    return low


def _bit_length(values: np.ndarray) -> np.ndarray:
    """Exact bit length of non-negative integers (float64's frexp alone rounds above 2**53)."""
    values = values.astype(np.uint64)
    high = values >> np.uint64(32)
    _, low_length = np.frexp((values & np.uint64(0xFFFFFFFF)).astype(np.float64))
    if not high.any():
        return low_length.astype(np.intp)
    _, high_length = np.frexp(high.astype(np.float64))
    return np.where(high > 0, high_length + 32, low_length).astype(np.intp)


def _bucket_labels(counts: np.ndarray) -> dict[str, int]:
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


def _values(raw_bits: np.ndarray, fmt: bits.FloatFormat) -> np.ndarray:
    """Values for error arithmetic: float32 for the 16-bit formats (which it holds exactly), else float64."""
    if fmt.name == "bfloat16":  # bf16 is the top half of a float32: a shift is exact and faster than a cast
        return (raw_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return raw_bits.view(fmt.float_dtype).astype(np.float32 if fmt.width <= 16 else np.float64)


def _as_float64(raw_bits: np.ndarray, fmt: bits.FloatFormat) -> np.ndarray:
    if fmt.name == "bfloat16":  # bf16 is the top half of a float32: a shift is exact and faster than a cast
        return (raw_bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    return raw_bits.astype(fmt.bits_dtype).view(fmt.float_dtype).astype(np.float64)


def _largest_finite_magnitude(raw_bits: np.ndarray, fmt: bits.FloatFormat) -> float:
    magnitude = raw_bits & bits.magnitude_mask(fmt)
    largest = np.max(magnitude, where=magnitude < bits.infinity_bits(fmt), initial=0)
    return float(_as_float64(np.array([largest]), fmt)[0])


_FINE_BUCKETS = _bit_length(np.arange(FINE_ULPS - 1, dtype=np.uint64))  # bucket of ULP 1 .. FINE_ULPS-1
