"""``bits128v1`` (harness.run.bits128: the definition) in Paddle, on the place that holds the tensor: the same code on
a CPU and a GPU (tests/test_bits128.py runs it on the CPU; the Paddle training runner trains on the CPU only and hands
the writer host arrays today, whose host digest is XXH3: this is for a Paddle side that keeps its state on a GPU).

As in torch (harness.runners.torch.digest): int64 words, products and sums wrapping modulo 2^64 in two's complement,
a logical shift as an arithmetic one and a mask; every constant is an int64 tensor (a Python integer operand may go
through a float scale in Paddle's elementwise ops).
"""

from __future__ import annotations

from harness.run.bits128 import KEYS, MIXERS, finish, signed

CHUNK_WORDS = {"cpu": 1 << 16, "gpu": 1 << 24}


def _const(paddle, value: int, place):
    return paddle.to_tensor(value, dtype="int64", place=place)


def _words(paddle, tensor):
    """The definition's words as a flat int64 tensor on the tensor's place."""
    if not tensor.numel():
        return paddle.zeros([0], dtype="int64").to(tensor.place)
    flat = tensor.detach().contiguous().flatten()
    if flat._offset():  # Paddle 3.3's view(dtype) reads a view from its storage's start, not from its offset
        flat = flat.clone()
    raw = paddle.view(flat, paddle.uint8)
    size = int(raw.numel())
    whole = size // 8 * 8
    head = paddle.view(raw[:whole].contiguous(), paddle.int64) if whole else paddle.zeros([0], dtype="int64")
    if whole == size:
        return head
    tail = paddle.concat([raw[whole:], paddle.zeros([8 - (size - whole)], dtype="uint8").to(raw.place)])
    return paddle.concat([head.to(raw.place), paddle.view(tail, paddle.int64)])


def lane_sums(tensor, chunk: int | None = None):
    """``[S_0, S_1]`` of a Paddle tensor as an int64 tensor on its place."""
    import paddle

    w = _words(paddle, tensor)
    place = w.place
    chunk = chunk or CHUNK_WORDS["gpu" if place.is_gpu_place() else "cpu"]
    keys = [_const(paddle, signed(k), place) for k in KEYS]
    mixers = [[(_const(paddle, s, place), _const(paddle, (1 << (64 - s)) - 1, place), _const(paddle, signed(m), place))
               for s, m in ((s1, m1), (s2, m2), (s3, 1))] for s1, m1, s2, m2, s3 in MIXERS]
    sums = [paddle.zeros([], dtype="int64").to(place) for _ in KEYS]
    total = int(w.numel())
    for start in range(0, total, chunk):
        part = w[start:start + chunk]
        index = paddle.arange(start, start + int(part.numel()), dtype="int64").to(place)
        for lane in (0, 1):
            x = paddle.bitwise_xor(paddle.multiply(index, keys[lane]), part)
            for step, (shift, mask, multiplier) in enumerate(mixers[lane]):
                x = paddle.bitwise_xor(x, paddle.bitwise_and(paddle.bitwise_right_shift(x, shift), mask))
                if step < 2:
                    x = paddle.multiply(x, multiplier)
            sums[lane] = sums[lane] + paddle.sum(x)
    return paddle.stack(sums)


def digests(tensors) -> list[str]:
    """``bits128v1`` of each Paddle tensor, computed where it is."""
    tensors = list(tensors)
    sums = [lane_sums(t).cpu().numpy().tolist() for t in tensors]
    return [finish(pair, int(t.numel()) * t.element_size()) for pair, t in zip(sums, tensors, strict=True)]


def digest(tensor) -> str:
    return digests([tensor])[0]
