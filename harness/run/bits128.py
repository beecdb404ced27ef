"""``bits128v1``: a 128-bit digest of a tensor's raw bits that every stack computes on the device that holds the
tensor (a GPU tensor on its GPU, so only 16 bytes per tensor come to the host), with the same bits everywhere.

The definition (framework-free; every value an unsigned 64-bit integer, every operation modulo 2^64, ``>>`` a logical
shift, ``^`` exclusive or):

1. ``B``: the tensor's bytes in canonical layout (row-major, contiguous: what ``numpy.ascontiguousarray(a).tobytes()``
   gives; the dtype's own little-endian encoding), ``n = len(B)``.
2. ``B`` padded with zero bytes to a multiple of 8; ``w_i`` (i = 0 .. m - 1, m = ceil(n / 8)): the little-endian
   64-bit word of bytes 8i .. 8i + 7.
3. Two lanes, L = 0 and 1, each with its index key ``K_L`` and its mixer ``mix_L``::

       K_0 = 0x9e3779b97f4a7c15
       mix_0(x): x ^= x >> 33; x *= 0xff51afd7ed558ccd; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53; x ^= x >> 33
       K_1 = 0xc2b2ae3d27d4eb4f
       mix_1(x): x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27; x *= 0x94d049bb133111eb; x ^= x >> 31

       S_L = sum over i of mix_L(w_i ^ (i * K_L))

   (``mix_0`` is MurmurHash3's 64-bit finaliser, ``mix_1`` SplitMix64's.)
4. ``h_L = mix_L(S_L ^ n ^ K_L)``; the digest is ``bits128v1:`` followed by ``h_0`` and then ``h_1``, each as 16
   lower-case hex digits.

Why equal digests mean equal bits, and what it costs:

- **Any reduction order gives the same bits**: ``S_L`` is a sum of integers modulo 2^64 (no rounding), so a GPU's tree
  reduction, a CPU's vector lanes, chunks summed in any order and numpy's pairwise sum all give one value.
- **A difference confined to one 64-bit word** (every single-bit flip) **is always found**, on both lanes: for a
  fixed i, ``w -> w ^ (i * K_L)`` is a bijection and so is ``mix_L`` (an xor with a right shift of itself and a
  multiplication by an odd constant are both invertible), so the word's term changes and no other term does.
- **Differences in several words** go unnoticed only if their terms' changes sum to 0 modulo 2^64 in both lanes:
  about 2^-64 per lane for the accidental differences the harness looks for (the mixers behave as random functions of
  their input), about 2^-128 for both; over a run of 10^7 digested tensors about 10^-31. It is not a cryptographic
  hash: the sum is linear, so someone who wants two tensors with one digest can build them. The harness compares
  stacks, not adversaries.
- **Places matter**: the index enters each term before the mixer, so two swapped or moved words change the sum.
- **Length matters**: ``n`` enters the finish, so the zero padding never looks like data (``K_L`` there keeps the
  empty tensor's digest from being zeros); the comparator also checks each digested tensor's dtype and shape before
  its digest.

The name ``bits128v1`` is in every digest, so a digest made another way (``xxh3_128:`` of the host path) never equals
it. This module holds the definition's constants, the host reference (numpy) and the finish; the torch and Paddle
implementations (``harness.runners.torch.digest``, ``harness.runners.paddle.digest``) compute ``S_0`` and ``S_1`` on
the tensor's device with the same arithmetic in signed 64-bit integers (two's complement: the same bits); Paddle's
finishes with ``finish`` here, torch's a step's tensors at once where their sums are (``digest.finished``).
"""

from __future__ import annotations

import numpy as np

ALGORITHM = "bits128v1"
MASK64 = (1 << 64) - 1
KEYS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
# per lane: (shift, multiplier, shift, multiplier, shift)
MIXERS = ((33, 0xFF51AFD7ED558CCD, 33, 0xC4CEB9FE1A85EC53, 33),
          (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31))
CHUNK_WORDS = 1 << 16  # the host reference's words per pass (512 KB: each pass's temporaries stay in the cache)


def signed(value: int) -> int:
    """An unsigned 64-bit constant as the signed 64-bit integer with the same bits (torch and Paddle have no uint64
    arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def mix(lane: int, x: int) -> int:
    """``mix_L`` on one Python integer (the finish, and the definition's plainest statement)."""
    s1, m1, s2, m2, s3 = MIXERS[lane]
    x ^= x >> s1
    x = (x * m1) & MASK64
    x ^= x >> s2
    x = (x * m2) & MASK64
    return x ^ (x >> s3)


def finish(sums, nbytes: int) -> str:
    """The digest of a tensor of `nbytes` bytes from its two lane sums ``S_0``, ``S_1`` (any integers: taken modulo
    2^64, so signed 64-bit sums give the same digest as unsigned ones)."""
    h = [mix(lane, (int(s) & MASK64) ^ nbytes ^ KEYS[lane]) for lane, s in enumerate(sums)]
    return f"{ALGORITHM}:{h[0]:016x}{h[1]:016x}"


def words(raw: np.ndarray) -> np.ndarray:
    """The little-endian 64-bit words ``w_i`` of a flat uint8 array, zero-padded (a copy only of a tail that is not
    a whole word)."""
    whole = raw.size // 8 * 8
    head = raw[:whole].view("<u8")
    if whole == raw.size:
        return head
    tail = np.zeros(8, np.uint8)
    tail[:raw.size - whole] = raw[whole:]
    return np.concatenate([head, tail.view("<u8")])


def lane_sums_numpy(array: np.ndarray, chunk: int = CHUNK_WORDS) -> tuple[int, int]:
    """``(S_0, S_1)`` of a numpy array (the host reference), a chunk of words at a time."""
    w = words(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    sums = [0, 0]
    x, t = np.empty(min(chunk, w.size), np.uint64), np.empty(min(chunk, w.size), np.uint64)
    for start in range(0, w.size, chunk):
        part = w[start:start + chunk]
        n = part.size
        index = np.arange(start, start + n, dtype=np.uint64)
        for lane in (0, 1):
            s1, m1, s2, m2, s3 = MIXERS[lane]
            xs, ts = x[:n], t[:n]
            np.multiply(index, np.uint64(KEYS[lane]), out=xs)
            np.bitwise_xor(xs, part, out=xs)
            for shift, multiplier in ((s1, m1), (s2, m2)):
                np.right_shift(xs, np.uint64(shift), out=ts)
                np.bitwise_xor(xs, ts, out=xs)
                np.multiply(xs, np.uint64(multiplier), out=xs)
            np.right_shift(xs, np.uint64(s3), out=ts)
            np.bitwise_xor(xs, ts, out=xs)
            sums[lane] = (sums[lane] + int(xs.sum(dtype=np.uint64))) & MASK64
    return sums[0], sums[1]


def digest_numpy(array: np.ndarray) -> str:
    """``bits128v1`` of a numpy array's bits (any dtype, any layout: its canonical, C-contiguous bytes)."""
    array = np.asarray(array)
    return finish(lane_sums_numpy(array), array.nbytes)
