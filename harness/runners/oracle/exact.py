"""Correctly rounded matrix products for the truth oracle, vectorized: no Python loop over elements.

``correctly_rounded_product(left, right, shift, dtype)`` returns ``left @ right (+ shift)`` with every element
the exact value rounded once, to nearest even, to ``dtype`` (bfloat16, float16 or float32). numpy only.

How, per block of output rows:

1. **float64 GEMM and a rigorous bound.** ``approx = left @ right (+ shift)``; every term is an exact float64
   product (inputs are bf16/fp16/fp32: at most 24-bit significands, so a product has at most 48 bits), and the
   float64 sum of K terms is within ``gamma_K * sum |a_k b_k|`` of the exact sum (Higham, Thm 3.1, any order,
   ``gamma_K = K u / (1 - K u)``, ``u = 2**-53``). ``sum |a_k b_k| <= |a| |b|`` (Cauchy-Schwarz), with
   ``(1 + 2 gamma)`` covering the norms' own rounding.

2. **Which elements are settled.** The rounding of a value to the output format is constant between two
   consecutive *midpoints* (halfway points between neighbouring output values). If the interval ``approx +-
   bound`` holds no midpoint, every point in it, the exact sum included, rounds alike. A cheap test first (all
   float64 arithmetic, exact where it matters): for ``|approx|`` in the binade ``[2**(e-1), 2**e)`` of the
   output's normal range, with output ULP ``u = 2**(e-p)`` (p: the output's precision) and ``r = |approx| mod
   u`` (exact: a power-of-two scaling, ``floor``, and a subtraction whose result is representable), the nearest
   midpoints are at distance ``|r - u/2|`` (the one between the two neighbours) and at least ``r + u/4`` below
   (the lowest midpoint under ``2**(e-1)`` is ``u/4`` below it; the next binade down has half the ULP); any
   other midpoint is farther. So ``d = min(|r - u/2|, r + u/4)`` is a lower bound on the distance to every
   midpoint, and an element with ``bound + |approx| 2**-50`` (four float64 ULPs for the interval's own
   rounding) ``< d`` is settled. Elements this test does not settle get the original test: round both ends
   of the (outward-rounded) interval with ``round_once`` and compare the bits; those that differ are *unsure*.
   Settled elements that are also farther than one float32 ULP from every midpoint are cast with numpy's
   ``astype`` (any cast that lands within a float32 ULP of the value, a direct rounding or one through
   float32, stays on the value's side of the midpoint: midpoints are float32 values); the rest of the
   settled ones go through ``round_once`` (rounding to odd first, see oracle.py).

3. **Unsure elements: exact sums in 32-bit digits.** For each unsure element the terms ``a_k b_k`` (exact
   products, and the shift) are split into *pieces* aligned to a fixed grid of 32-bit digit positions: digit
   ``b`` has unit ``2**(L + 32 b)`` with ``L = -384``. For a term ``t`` whose leading bit lies in digit ``h``
   (unit ``U``): ``hi = floor(t / U) U``, ``r1 = t - hi``; ``mid = floor(r1 / (U 2**-32)) U 2**-32``,
   ``lo = r1 - mid``. All of these are exact: dividing by a power of two is exact (no underflow: every value is
   at least ``2**-298``, the smallest product of two fp32 subnormals, far above float64's subnormals),
   ``floor`` is exact, ``hi`` and ``mid`` are the quotient (an integer below ``2**32`` in magnitude) times a
   power of two, and each difference is representable (it is a multiple of ``ulp(t) >= 2**(e-53)`` below the
   unit it was cut at, so it needs at most 53 bits), hence computed exactly. ``lo`` is a multiple of ``ulp(t)
   >= U 2**-52 >= U 2**-64``, the unit of digit ``h - 2``, and below ``U 2**-32``: so every term is exactly
   ``hi + mid + lo``, three integers below ``2**32`` in magnitude times the units of digits ``h, h-1, h-2``
   (``hi`` may be negative; ``mid``, ``lo`` are not). Every nonzero product of inputs is a multiple of
   ``2**-298`` and below ``2**256``, so ``h`` lies in ``[2, 21]`` of 22 digits (units up to ``2**288``, and a
   sum of fewer than ``2**21`` terms stays below ``2**278``).

   Per digit, the integer quotients are summed with ``numpy.bincount`` (float64 accumulation). Each digit gets
   at most one piece per term, each at most ``2**32`` in magnitude, so every partial sum, in any order, is an
   integer below ``K 2**32 < 2**53`` for ``K < 2**21`` terms: exact. The digit sums go to int64 (exact) and
   carries propagate upward (``c = s >> 32``, floor division, ``s & 0xffffffff``), leaving digits in ``[0,
   2**32)`` and a top digit of 0 (sum >= 0) or -1 (sum < 0); negative sums are negated (the digit sums, then
   propagated again). Now the exact ``|sum|`` is a 704-bit integer in 22 nonnegative digits.

4. **Rounding once.** With ``d_h`` the highest nonzero digit, the 64-bit window ``w`` is ``d_h, d_(h-1)`` and
   the top bits of ``d_(h-2)``, shifted so that bit 63 is set; everything below it is the *sticky* part. ``m = w
   >> 11`` (53 bits) with its last bit or-ed with "anything nonzero below" is the sum rounded to odd to 53 bits
   (RO53): truncation, then a set last bit when inexact. ``m * 2**E`` is exact in float64 (``m < 2**53``,
   no over- or underflow). Rounding RO53(x) to nearest even at precision ``p <= 51`` equals rounding x itself
   (Boldo & Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd",
   2008: round-to-odd at ``p + 2`` bits or more, then to nearest, is a correct rounding), and round-to-odd
   composes (RO24(RO53(x)) = RO24(x)), so ``round_once`` (float64 -> float32 to odd, then to bf16/fp16 to
   nearest even; or float64 -> float32 to nearest even) rounds RO53(x) exactly as it would round x. An exact
   zero sum gives +0 (IEEE's sum of mixed-sign terms that cancel).

Nothing here loops over elements in Python: loops run over row blocks, chunks of unsure elements (at most
about 2**21 terms at a time) and the 22 digits.
"""

from __future__ import annotations

import math

import numpy as np

_BITS = {2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}
PRECISION = {"bfloat16": 8, "float16": 11, "float32": 24}  # significand bits, the implicit one included
DIGIT_BITS = 32
DIGITS = 22
LOWEST_UNIT = -384  # exponent of digit 0's unit
MAX_TERMS = 2**21 - 2  # each digit's sum of terms stays below 2**53
GEMM_ELEMENTS = 1 << 21  # output elements per float64 GEMM call
PASS_ELEMENTS = 1 << 16  # output elements per screening pass (its temporaries stay in cache)
CHUNK_TERMS = 1 << 21  # terms per chunk of the exact pass


def correctly_rounded_product(left: np.ndarray, right: np.ndarray, shift: np.ndarray | None, dtype: np.dtype,
                              round_once) -> tuple[np.ndarray, int]:
    """left @ right (+ shift) rounded once to `dtype`, exact for every element; also how many needed the
    exact path. `left`, `right`, `shift`: float64 holding bf16/fp16/fp32 values; `round_once`: the oracle's
    float64 -> dtype rounding (to odd through float32)."""
    dtype = np.dtype(dtype)
    left = np.ascontiguousarray(left)  # row blocks of it; `right` may stay a transposed view (BLAS reads it so)
    rows, cols = left.shape[0], right.shape[1]
    terms = left.shape[1] + (shift is not None)
    if terms > MAX_TERMS:
        raise ValueError(f"{terms} terms per element: the exact path sums at most {MAX_TERMS}")
    gamma = terms * 2.0**-53 / (1 - terms * 2.0**-53)
    norms = np.sqrt(np.einsum("ij,ij->i", left, left)), np.sqrt(np.einsum("ij,ij->j", right, right))
    screen = _Screen(dtype, gamma, *norms, shift)
    out = np.empty((rows, cols), dtype)
    unsure_rows, unsure_cols = [], []
    gemm_rows = max(1, GEMM_ELEMENTS // max(cols, 1))
    pass_rows = max(1, PASS_ELEMENTS // max(cols, 1))
    for start in range(0, rows, gemm_rows):
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite inputs give IEEE's inf and NaN
            approx = left[start:start + gemm_rows] @ right
            if shift is not None:
                approx += shift
        near, unsettled = [], []  # (row, col) within `approx` of elements the screen leaves to round_once / the test
        for offset in range(0, approx.shape[0], pass_rows):
            value = approx[offset:offset + pass_rows]
            settled, far = screen.settled(value, start + offset)
            out[start + offset:start + offset + value.shape[0]] = value.astype(dtype)  # right where `far` holds
            if not far.all():
                where = np.nonzero(~far)
                near.append((where[0] + offset, where[1]))
                if settled is not far:
                    where = np.nonzero(~settled)
                unsettled.append((where[0] + offset, where[1]))
        if near:
            r, c = (np.concatenate(parts) for parts in zip(*near, strict=True))
            out[r + start, c] = round_once(approx[r, c], dtype)
        if unsettled:
            r, c = (np.concatenate(parts) for parts in zip(*unsettled, strict=True))
            differ = screen.straddles(approx[r, c], r + start, c, round_once)
            unsure_rows.append(r[differ] + start)
            unsure_cols.append(c[differ])
    i = np.concatenate(unsure_rows) if unsure_rows else np.zeros(0, np.intp)
    j = np.concatenate(unsure_cols) if unsure_cols else np.zeros(0, np.intp)
    if len(i):
        out[i, j] = exact_dot_rounded(left, right, shift, i, j, dtype, round_once)
    return out, len(i)


class _Screen:
    """Which elements of a block are settled (no rounding boundary within the bound) and far (also none
    within a float32 ULP), cheaply; and, for the rest, the exact straddle test. See the module docstring."""

    def __init__(self, dtype: np.dtype, gamma: float, left_norms: np.ndarray, right_norms: np.ndarray,
                 shift: np.ndarray | None):
        self.dtype, self.gamma = dtype, gamma
        self.left_norms, self.right_norms, self.shift = left_norms, right_norms, shift
        self.precision = PRECISION[dtype.name]
        info = np.finfo(np.float32) if dtype.name == "float32" else _finfo(dtype)
        self.smallest_normal, self.largest = float(info.smallest_normal), float(info.max)
        if self.precision < 24:  # float32 screen: the bound, rounded up into float32 (see settled_float32)
            slack = gamma * (1 + 2 * gamma) * (1 + 2.0**-20)
            with np.errstate(over="ignore"):
                self.left32 = (left_norms * slack).astype(np.float32)
                self.right32 = (right_norms * (1 + 2.0**-20)).astype(np.float32)
                self.shift32 = None if shift is None else (np.abs(shift) * slack).astype(np.float32)
            low, high = 4 * self.smallest_normal, self.largest / 4
            self.exponent_low = np.float32(2.0 ** math.floor(math.log2(low))).view(np.uint32)
            self.exponent_high = np.float32(2.0 ** math.floor(math.log2(high))).view(np.uint32)

    def bound(self, first: int, count: int) -> np.ndarray:
        """The float64 bound of rows first.. (gamma * magnitude * (1 + 2 gamma), as the original test)."""
        magnitude = np.outer(self.left_norms[first:first + count], self.right_norms)
        if self.shift is not None:
            magnitude += np.abs(self.shift)
        return self.gamma * magnitude * (1 + 2 * self.gamma)

    def settled(self, value: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
        if self.precision < 24:
            return self.settled_float32(value, first)
        settled = _settled(value, self.bound(first, value.shape[0]), self.precision, self.smallest_normal,
                           self.largest)
        return settled, settled  # float32 output: numpy's cast rounds once, to nearest even

    def settled_float32(self, value: np.ndarray, first: int) -> tuple[np.ndarray, np.ndarray]:
        """bf16/fp16 outputs, in float32 arithmetic (half the memory traffic). v32 = RN32(value) lies within
        half a float32 ULP of value. In float32's bits, the low 24 - p bits r of v32's significand place it
        between two output values: the midpoints are |r - h| float32 ULPs away (h = 2**(23 - p)) and at least
        r + h/2 below (the binade under it has half the spacing), so d = min(|r - h|, r + h/2) - 8 ULPs,
        computed exactly (integers, then a power-of-two scale), is a lower bound on value's distance to every
        midpoint less 7.5 float32 ULPs. `settled` claims d > bound (rounded up into float32; where the
        float32 bound is subnormal or zero its absolute error is below 2**-150, less than one step of d):
        so no midpoint lies within the bound plus more than a float32 ULP, which is also `far`."""
        v32 = value.astype(np.float32)
        raw = v32.view(np.uint32)
        exponent = raw & np.uint32(0x7F800000)
        half = 1 << (23 - self.precision)
        r = (raw & np.uint32((1 << (24 - self.precision)) - 1)).view(np.int32)
        d = np.abs(r - np.int32(half))
        r += np.int32(half // 2)
        np.minimum(d, r, out=d)
        d -= np.int32(8)
        room = d.astype(np.float32)
        room *= exponent.view(np.float32)
        room *= np.float32(2.0**-23)
        with np.errstate(over="ignore"):
            bound = np.outer(self.left32[first:first + value.shape[0]], self.right32)
            if self.shift32 is not None:
                bound += self.shift32
        settled = room > bound
        settled &= exponent >= self.exponent_low
        settled &= exponent <= self.exponent_high
        return settled, settled

    def straddles(self, value: np.ndarray, rows: np.ndarray, cols: np.ndarray, round_once) -> np.ndarray:
        """The exact test: both ends of the outward-rounded interval, rounded once, differ in their bits."""
        magnitude = self.left_norms[rows] * self.right_norms[cols]
        if self.shift is not None:
            magnitude += np.abs(self.shift[cols])
        width = self.gamma * magnitude * (1 + 2 * self.gamma)
        bits = _BITS[self.dtype.itemsize]
        with np.errstate(invalid="ignore"):
            low = round_once(np.nextafter(value - width, -np.inf), self.dtype).view(bits)
            high = round_once(np.nextafter(value + width, np.inf), self.dtype).view(bits)
        return low != high


def _finfo(dtype: np.dtype):
    import ml_dtypes

    return ml_dtypes.finfo(dtype) if dtype.name == "bfloat16" else np.finfo(dtype)


def _settled(approx: np.ndarray, bound: np.ndarray, precision: int, smallest_normal: float,
             largest: float) -> np.ndarray:
    """No midpoint of the output format within the bound plus four float64 ULPs, claimed only inside the
    output's normal range (see the module docstring)."""
    size = np.abs(approx)
    _, e = np.frexp(size)  # size in [2**(e-1), 2**e)
    ulp = np.ldexp(1.0, e - precision)
    with np.errstate(invalid="ignore"):
        r = size - np.floor(size / ulp) * ulp
        d = np.minimum(np.abs(r - 0.5 * ulp), r + 0.25 * ulp)
        in_range = (size >= 4 * smallest_normal) & (size <= 0.25 * largest)
        return (bound + size * 2.0**-50 < d) & in_range


def exact_dot_rounded(left: np.ndarray, right: np.ndarray, shift: np.ndarray | None, i: np.ndarray, j: np.ndarray,
                      dtype: np.dtype, round_once) -> np.ndarray:
    """Element (i[n], j[n]) of left @ right (+ shift), each the exact value rounded once to `dtype`."""
    per_chunk = max(1, CHUNK_TERMS // (left.shape[1] + 1))
    results = []
    for start in range(0, len(i), per_chunk):
        rows, cols = i[start:start + per_chunk], j[start:start + per_chunk]
        terms = left[rows] * right[:, cols].T  # exact: products of two <= 24-bit significands
        if shift is not None:
            terms = np.concatenate([terms, shift[cols][:, None]], axis=1)
        finite = np.isfinite(terms).all(axis=1)
        sums = np.empty(len(rows))
        sums[finite] = exact_sums_rounded_to_odd(terms[finite])
        with np.errstate(invalid="ignore"):
            sums[~finite] = terms[~finite].sum(axis=1)  # an infinity or NaN among the inputs: IEEE's answer
        results.append(round_once(sums, dtype))
    return np.concatenate(results) if results else np.zeros(0, dtype)


def exact_sums_rounded_to_odd(terms: np.ndarray) -> np.ndarray:
    """Each row's exact sum, rounded to odd to float64's 53 bits (the module docstring, steps 3 and 4).

    `terms`: float64 [n, K], every value zero or a multiple of 2**-298 below 2**256 in magnitude (a product of
    two bf16/fp16/fp32 values, or one such value), K < 2**21. Exact zero sums give +0.
    """
    terms = np.asarray(terms, np.float64)
    n, k = terms.shape
    if k > MAX_TERMS:
        raise ValueError(f"{k} terms per row: at most {MAX_TERMS}")
    if not np.isfinite(terms).all():
        raise ValueError("exact sums need finite terms")
    digits = _digit_sums(terms)  # [n, DIGITS] int64, exact, not yet normalized
    digits = _propagate(digits)
    negative = digits[:, -1] < 0
    if negative.any():
        digits[negative] = _propagate(-_digit_sums(terms[negative]))
    return np.where(negative, -1.0, 1.0) * _round_to_odd(digits)


def _digit_sums(terms: np.ndarray) -> np.ndarray:
    n, k = terms.shape
    _, e = np.frexp(terms)  # |t| in [2**(e-1), 2**e); zeros give e = 0 and split into zeros
    top = np.clip((e - 1 - LOWEST_UNIT) // DIGIT_BITS, 2, DIGITS - 1)
    unit = np.ldexp(1.0, LOWEST_UNIT + DIGIT_BITS * top)
    q_hi = np.floor(terms / unit)
    rest = terms - q_hi * unit
    unit *= 2.0**-DIGIT_BITS
    q_mid = np.floor(rest / unit)
    rest -= q_mid * unit
    unit *= 2.0**-DIGIT_BITS
    q_lo = rest / unit
    if not np.array_equal(q_lo, np.floor(q_lo)) or not (q_lo < 2.0**DIGIT_BITS).all():
        raise ValueError("a term is not a multiple of 2**-320: not a product of bf16/fp16/fp32 values")
    base = (np.arange(n) * DIGITS)[:, None]
    total = np.zeros(n * DIGITS)
    for quotient, offset in ((q_hi, 0), (q_mid, 1), (q_lo, 2)):
        total += np.bincount((base + top - offset).ravel(), weights=quotient.ravel(), minlength=n * DIGITS)
    return total.reshape(n, DIGITS).astype(np.int64)  # integers below 2**53: exact


def _propagate(digits: np.ndarray) -> np.ndarray:
    """Carry upward so that digits 0..DIGITS-2 lie in [0, 2**32); the top digit keeps the sign (0 or -1)."""
    digits = digits.copy()
    mask = np.int64((1 << DIGIT_BITS) - 1)
    for b in range(DIGITS - 1):
        carry = digits[:, b] >> DIGIT_BITS  # floor division by 2**32, also for negatives
        digits[:, b] &= mask
        digits[:, b + 1] += carry
    return digits


def _round_to_odd(digits: np.ndarray) -> np.ndarray:
    """Nonnegative digits [n, DIGITS] -> each row's value rounded to odd to 53 bits, as float64."""
    n = digits.shape[0]
    padded = np.concatenate([np.zeros((n, 2), np.int64), digits], axis=1).astype(np.uint64)  # digit b at b + 2
    nonzero = padded != 0
    any_nonzero = nonzero.any(axis=1)
    h = padded.shape[1] - 1 - np.argmax(nonzero[:, ::-1], axis=1)  # highest nonzero (padded index)
    h = np.where(any_nonzero, h, 2)
    rows = np.arange(n)
    top, second, third = padded[rows, h], padded[rows, h - 1], padded[rows, h - 2]
    below = np.cumsum(nonzero, axis=1)  # below[r, c]: nonzero digits at padded index <= c
    sticky = below[rows, np.maximum(h - 3, 0)] > 0
    width = np.frexp(top.astype(np.float64))[1].astype(np.uint64)  # bit length of top (exact: top < 2**32)
    s = np.uint64(DIGIT_BITS) - width  # shift that sets bit 63 of the window; 0..31 when top != 0
    s = np.where(any_nonzero, s, np.uint64(0))
    window = ((top << np.uint64(32)) | second) << s
    cut = np.uint64(32) - s  # 1..32 bits of `third` fall below the window
    window |= third >> cut
    sticky |= (third & ((np.uint64(1) << cut) - np.uint64(1))) != 0
    sticky |= (window & np.uint64(0x7FF)) != 0
    m = (window >> np.uint64(11)) | sticky.astype(np.uint64)
    # window bit 0 has weight 2**(L + 32 (h - 3) - s) (padded index h is digit h - 2; `second` is digit h - 3)
    exponent = LOWEST_UNIT + DIGIT_BITS * (h.astype(np.int64) - 3) - s.astype(np.int64) + 11
    return np.where(any_nonzero, np.ldexp(m.astype(np.float64), exponent.astype(np.int32)), 0.0)
