"""ULP distance, checked against numpy's own references and by properties, for all four formats.

References: numpy.testing's ``integer_repr`` (its sign-magnitude ordering), ``nulp_diff`` and
``assert_array_max_ulp`` for float16/32/64; ``numpy.nextafter`` on ml_dtypes bfloat16 for bf16; and every
bit pattern of the 16-bit formats sorted by value. Deliberately wrong implementations (named fake_*) are
run through the same checks to show that the checks can fail.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from numpy.testing._private.utils import integer_repr, nulp_diff

from harness import bits
from harness.compare.tensors import compare_tensor

NUMPY_FORMATS = ["float16", "float32", "float64"]
ALL_FORMATS = ["bfloat16", *NUMPY_FORMATS]
PROPERTY_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                             suppress_health_check=[HealthCheck.too_slow])


def distance(ulp, fmt, a: int, b: int) -> int:
    """One distance between two bit patterns given as Python ints."""
    pattern = np.array([a, b], dtype=fmt.bits_dtype)
    return int(ulp(pattern[:1], pattern[1:], fmt)[0])


def value(fmt, pattern: int) -> float:
    return float(np.array([pattern], dtype=fmt.bits_dtype).view(fmt.float_dtype).astype(np.float64)[0])


def non_nan(fmt):
    """Any non-NaN pattern, with the edges (zeros, smallest subnormals, one, largest, infinities) drawn often."""
    sign = 1 << (fmt.width - 1)
    edges = [0, 1, int(bits.infinity_bits(fmt)) - 1, int(bits.infinity_bits(fmt)),
             int(np.array(1.0, fmt.float_dtype).view(fmt.bits_dtype))]
    any_pattern = st.integers(0, 2**fmt.width - 1).filter(lambda p: not bits.is_nan(np.array(p, fmt.bits_dtype), fmt))
    return st.one_of(st.sampled_from(edges + [e | sign for e in edges]), any_pattern)


def next_up(fmt, pattern: int) -> int:
    """The pattern of the next larger value, by numpy.nextafter (ml_dtypes provides it for bfloat16)."""
    x = np.array([pattern], dtype=fmt.bits_dtype).view(fmt.float_dtype)
    with np.errstate(over="ignore"):  # largest finite -> inf
        return int(np.nextafter(x, np.array([np.inf], dtype=fmt.float_dtype)).view(fmt.bits_dtype)[0])


# -- wrong on purpose: each must fail the checks below -------------------------------------------------------

def fake_ulp_ignoring_sign(a_bits, b_bits, fmt):
    magnitude = bits.magnitude_mask(fmt)
    return np.abs((a_bits & magnitude).astype(np.int64) - (b_bits & magnitude).astype(np.int64)).astype(np.uint64)


def fake_ulp_sign_magnitude(a_bits, b_bits, fmt):
    """Difference of the raw bit patterns read as unsigned integers."""
    return np.abs(a_bits.astype(np.int64) - b_bits.astype(np.int64)).astype(np.uint64)


def fake_ulp_minus_zero_below_plus_zero(a_bits, b_bits, fmt):
    """The common 'ordered' mapping ~x for negatives: -0 sits one step below +0."""
    def order(x):
        magnitude = (x & bits.magnitude_mask(fmt)).astype(np.int64)
        return np.where(bits.sign_bit(x, fmt), -magnitude - 1, magnitude)
    return np.abs(order(a_bits) - order(b_bits)).astype(np.uint64)


FAKES = [fake_ulp_ignoring_sign, fake_ulp_sign_magnitude, fake_ulp_minus_zero_below_plus_zero]


def check_properties(ulp, fmt, a: int, b: int, c: int) -> None:
    """Symmetric; zero exactly for equal bits or the two zeros; one for neighbours; additive along a monotone run."""
    d_ab, d_ba = distance(ulp, fmt, a, b), distance(ulp, fmt, b, a)
    assert d_ab == d_ba, f"{fmt.name}: d({a:#x}, {b:#x}) = {d_ab} but d({b:#x}, {a:#x}) = {d_ba}"
    both_zero = value(fmt, a) == 0 and value(fmt, b) == 0
    assert (d_ab == 0) == (a == b or both_zero), f"{fmt.name}: d({a:#x}, {b:#x}) = {d_ab}"
    if value(fmt, a) < np.inf:
        up = next_up(fmt, a)
        assert distance(ulp, fmt, a, up) == 1, f"{fmt.name}: {a:#x} -> next {up:#x} is {distance(ulp, fmt, a, up)}"
    low, mid, high = sorted((a, b, c), key=lambda p: value(fmt, p))
    whole, parts = distance(ulp, fmt, low, high), distance(ulp, fmt, low, mid) + distance(ulp, fmt, mid, high)
    assert whole == parts, f"{fmt.name}: d({low:#x}, {high:#x}) = {whole} != {parts} via {mid:#x}"


EDGE_TRIPLES = {  # (a, b, c) patterns per format that every fake gets wrong somewhere
    "float32": [(0x80000000, 0x00000000, 0x00000001), (0xBF800000, 0x3F800000, 0x00000000),
                (0x80000001, 0x00000001, 0x3F800000)],
}


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_properties_hold(name):
    fmt = bits.FORMATS[name]

    @PROPERTY_SETTINGS
    @given(non_nan(fmt), non_nan(fmt), non_nan(fmt))
    def run(a, b, c):
        check_properties(bits.ulp_distance, fmt, a, b, c)
    run()


@pytest.mark.parametrize("fake", FAKES, ids=lambda f: f.__name__)
def test_wrong_implementations_fail_the_property_checks(fake):
    fmt = bits.FORMATS["float32"]
    with pytest.raises(AssertionError):
        for triple in EDGE_TRIPLES["float32"]:
            check_properties(fake, fmt, *triple)

    @settings(PROPERTY_SETTINGS, phases=[Phase.explicit, Phase.generate])  # finding is enough; no shrinking
    @given(non_nan(fmt), non_nan(fmt), non_nan(fmt))
    def run(a, b, c):
        check_properties(fake, fmt, a, b, c)
    with pytest.raises(AssertionError):  # hypothesis finds a counterexample by itself too
        run()


@pytest.mark.parametrize("name", NUMPY_FORMATS)
def test_ordering_equals_numpy_integer_repr(name):
    fmt = bits.FORMATS[name]
    rng = np.random.default_rng(1)
    patterns = rng.integers(0, 2**fmt.width, 20_000, dtype=np.uint64).astype(fmt.bits_dtype)
    patterns = patterns[~bits.is_nan(patterns, fmt)]
    expected = integer_repr(patterns.view(fmt.float_dtype).copy()).astype(np.int64)
    assert np.array_equal(bits.ordered(patterns, fmt).astype(np.int64), expected)


@pytest.mark.parametrize("name", NUMPY_FORMATS)
def test_distance_equals_numpy_nulp_diff_where_numpy_is_exact(name):
    """nulp_diff subtracts in the format's own integer width and returns floats: compare where that is exact."""
    fmt, dtype = bits.FORMATS[name], np.dtype(name)
    rng = np.random.default_rng(2)
    x = rng.standard_normal(5_000).astype(dtype)
    steps = rng.integers(-300, 300, x.size)
    y = (x.view(fmt.bits_dtype).astype(np.int64) + steps).astype(fmt.bits_dtype).view(dtype)  # same sign, near
    ours = bits.ulp_distance(bits.as_bits(x), bits.as_bits(y), fmt)
    assert np.array_equal(ours.astype(np.float64), nulp_diff(x, y)[0].astype(np.float64))
    worst = int(ours.max())
    np.testing.assert_array_max_ulp(x, y, maxulp=worst)
    with pytest.raises(AssertionError):
        np.testing.assert_array_max_ulp(x, y, maxulp=worst - 1)


@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_every_16_bit_pattern_in_value_order_is_one_step_apart(name):
    """Exhaustive: all non-NaN patterns sorted by value; neighbours are 1 ULP apart, -0 and +0 are 0 apart."""
    fmt = bits.FORMATS[name]
    patterns = np.arange(2**16, dtype=np.uint16)
    patterns = patterns[~bits.is_nan(patterns, fmt)]
    values = patterns.view(fmt.float_dtype).astype(np.float64)
    order = np.lexsort((patterns, values))  # -0 (0x8000) before +0 (0x0000) would not matter: both 0 apart
    steps = bits.ulp_distance(patterns[order][:-1], patterns[order][1:], fmt)
    zero_pair = (values[order][:-1] == 0) & (values[order][1:] == 0)
    assert steps[zero_pair].tolist() == [0]
    assert np.all(steps[~zero_pair] == 1)
    assert int(bits.ulp_distance(patterns[order][:1], patterns[order][-1:], fmt)[0]) == patterns.size - 2


def test_bfloat16_walk_with_nextafter_counts_every_step():
    fmt = bits.FORMATS["bfloat16"]
    x = np.array([-np.inf], dtype=ml_dtypes.bfloat16)
    start, taken = x.copy(), 0
    while x[0] < np.float32(3e38):
        x = np.nextafter(x, np.array([np.inf], dtype=ml_dtypes.bfloat16))
        taken += 1
        if taken % 997 == 0:
            assert int(bits.ulp_distance(bits.as_bits(start), bits.as_bits(x), fmt)[0]) == taken


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_special_values(name):
    fmt = bits.FORMATS[name]
    info = ml_dtypes.finfo(fmt.float_dtype) if name == "bfloat16" else np.finfo(fmt.float_dtype)
    v = np.array([0.0, -0.0, info.smallest_subnormal, -info.smallest_subnormal, info.tiny, info.max, np.inf,
                  -np.inf], dtype=fmt.float_dtype)
    zero, neg_zero, sub, neg_sub, tiny, big, inf, neg_inf = (bits.as_bits(v[i:i + 1]) for i in range(len(v)))
    d = lambda p, q: int(bits.ulp_distance(p, q, fmt)[0])  # noqa: E731
    subnormals = 2**fmt.mantissa_bits - 1
    assert (d(zero, neg_zero), d(zero, sub), d(neg_sub, sub), d(sub, tiny)) == (0, 1, 2, subnormals)
    assert d(big, inf) == 1
    assert d(neg_inf, inf) == 2 * int(bits.infinity_bits(fmt))


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_comparator_on_specials_in_every_format(name):
    """Signed zeros and NaN payloads are counted apart, infinities and subnormals are ordinary steps."""
    fmt = bits.FORMATS[name]
    a = np.array([0.0, np.nan, 1.0, np.inf, 0.0, 2.0], dtype=fmt.float_dtype)
    b = a.copy()
    b[0] = -0.0
    b.view(fmt.bits_dtype)[1] ^= fmt.bits_dtype.type(1)  # another NaN payload
    b[2] = np.nan
    b.view(fmt.bits_dtype)[3] -= fmt.bits_dtype.type(1)  # largest finite
    b.view(fmt.bits_dtype)[4] += fmt.bits_dtype.type(3)  # third subnormal
    result = compare_tensor("t", a, b)
    counts = (result.mismatches, result.signed_zero_diffs, result.nan_payload_diffs, result.nan_mismatches)
    assert counts == (5, 1, 1, 1)
    assert result.ulp_histogram == {"1": 1, "3-4": 1} and result.max_ulp == 3
