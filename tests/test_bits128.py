"""``bits128v1`` (harness.run.bits128), the digest each stack computes where the tensor is (issue 33): the host
reference against the definition written out in plain Python, numpy against torch against Paddle on the CPU for every
dtype a step holds and every layout a runner hands the writer, its sensitivity (every one-bit flip, a swap of two
words, the length), and its use in the step files: the writer's device digests, the comparator (a kept tensor checked
in the other side's algorithm; two algorithms refused), the step files' validation and the ranks' check. The GPU
test runs only where CUDA is (``-m gpu``; CI has none): docs/examples/speed/device_digest.py is the H200 command."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from harness.run import bits128, steps
from harness.runners.torch import digest as torch_digest
from tests.support.installed import absent

DTYPES = {"bfloat16": (ml_dtypes.bfloat16, torch.bfloat16), "float16": (np.float16, torch.float16),
          "float32": (np.float32, torch.float32), "float64": (np.float64, torch.float64),
          "int64": (np.int64, torch.int64)}
SIZES = [0, 1, 3, 4, 7, 8, 9, 13, 64, 1001]  # elements: empty, odd byte counts, whole words, several words


def plain(data: bytes) -> str:
    """The module docstring's definition, one word at a time in Python integers."""
    n = len(data)
    data += b"\0" * (-n % 8)
    sums = [0, 0]
    for i in range(len(data) // 8):
        word = int.from_bytes(data[8 * i:8 * i + 8], "little")
        for lane in (0, 1):
            sums[lane] = (sums[lane] + bits128.mix(lane, word ^ (i * bits128.KEYS[lane] & bits128.MASK64))) \
                & bits128.MASK64
    return bits128.finish(sums, n)


def values(dtype: str, size, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, size=size, dtype=np.int64)
    return rng.standard_normal(size).astype(DTYPES[dtype][0])


def as_torch(array: np.ndarray) -> torch.Tensor:
    """The same bits as a torch tensor (bf16 through its uint16 bits: torch does not read ml_dtypes)."""
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def as_paddle(array: np.ndarray):
    import paddle

    if array.dtype == ml_dtypes.bfloat16:  # Paddle's bf16 is its uint16 bits on the host
        return paddle.to_tensor(array.view(np.uint16)).view(paddle.bfloat16)
    return paddle.to_tensor(array)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_the_host_reference_is_the_definition_and_torch_gives_its_bits(dtype, size):
    array = values(dtype, size)
    expected = plain(array.tobytes())
    assert bits128.digest_numpy(array) == expected
    assert torch_digest.digest(as_torch(array)) == expected


@pytest.mark.skipif(absent("paddle"), reason="needs paddlepaddle (on CI: never skipped)")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paddle_gives_the_same_bits_on_the_cpu(dtype):
    from harness.runners.paddle import digest as paddle_digest

    for size in (*SIZES, (5, 7)):
        array = values(dtype, size)
        assert paddle_digest.digest(as_paddle(array)) == bits128.digest_numpy(array), size
    big = values(dtype, 40_003)
    assert paddle_digest.finish(paddle_digest.lane_sums(as_paddle(big), chunk=777).numpy().tolist(),
                                big.nbytes) == bits128.digest_numpy(big)
    assert paddle_digest.digest(as_paddle(np.asarray(values(dtype, 3)[1]))) == \
        bits128.digest_numpy(values(dtype, 3)[1])  # a 0-d tensor
    base = values(dtype, (6, 10))
    t = as_paddle(base)
    for view, array in [(t.T, base.T), (t[::2, 1:], base[::2, 1:]), (t.flatten()[3:50], base.reshape(-1)[3:50])]:
        assert paddle_digest.digest(view) == bits128.digest_numpy(array)  # a transpose, strides, a view at an offset


def test_any_chunking_gives_the_same_bits():
    """A sum modulo 2^64: the reduction's order and grouping do not change a bit."""
    array = values("float32", 100_003)
    expected = bits128.digest_numpy(array)
    for chunk in (7, 1000, 1 << 20):
        assert bits128.finish(bits128.lane_sums_numpy(array, chunk), array.nbytes) == expected
        assert bits128.finish(torch_digest.lane_sums(as_torch(array), chunk).tolist(), array.nbytes) == expected


def test_layouts_a_runner_hands_the_writer_are_digested_as_their_canonical_bytes():
    """Non-contiguous tensors (a transpose rule), views at any offset (a piece of a flattened tensor: a distributed
    optimizer's range), 0-d tensors: the bytes of the tensor in row-major order, as the host reference reads them."""
    base = values("bfloat16", (6, 10))
    t = as_torch(base)
    cases = {"transpose": (t.T, base.T), "piece at an odd element": (t.reshape(-1)[3:50], base.reshape(-1)[3:50]),
             "strided rows": (t[::2, 1:], base[::2, 1:]), "0-d": (t[2, 3], base[2, 3])}
    for name, (view, array) in cases.items():
        assert torch_digest.digest(view) == bits128.digest_numpy(array) == \
            plain(np.ascontiguousarray(array).tobytes()), name
    assert torch_digest.digest(t.T) != torch_digest.digest(t)  # the same bytes in another order


def test_every_one_bit_flip_and_a_swap_of_two_words_change_the_digest():
    array = values("float32", 11)  # 44 bytes: 5 whole words and a half
    raw = bytearray(array.tobytes())
    seen = {plain(bytes(raw))}
    for byte in range(len(raw)):
        for bit in range(8):
            flipped = bytearray(raw)
            flipped[byte] ^= 1 << bit
            seen.add(bits128.digest_numpy(np.frombuffer(bytes(flipped), np.uint8)))
    assert len(seen) == 1 + 8 * len(raw)
    big = values("bfloat16", 1 << 17)
    reference = torch_digest.digest(as_torch(big))
    for index in np.random.default_rng(1).integers(0, big.size, 64):  # one bit anywhere in a bigger one
        flipped = steps.flip_bit(big, [index], int(index) % 16)
        assert torch_digest.digest(as_torch(flipped)) != reference
        assert bits128.digest_numpy(flipped) != reference
    words = big.copy().view(np.uint64)
    words[[10, 5000]] = words[[5000, 10]]
    assert not np.array_equal(words.view(big.dtype), big)
    assert bits128.digest_numpy(words) != reference
    assert torch_digest.digest(as_torch(words.view(big.dtype))) != reference


def test_the_length_counts_and_the_algorithm_is_named():
    """Zero padding is not data: 3 bytes and the same 3 bytes with a zero after them differ; the empty tensor's digest
    is not zeros; the digest names bits128v1, so the host's xxh3_128 digest of the same bytes never equals it."""
    three, four = np.array([1, 2, 3], np.uint8), np.array([1, 2, 3, 0], np.uint8)
    assert bits128.digest_numpy(three) != bits128.digest_numpy(four)
    assert bits128.digest_numpy(np.zeros(0, np.uint8)) != "bits128v1:" + "0" * 32
    array = values("float32", 8)
    assert bits128.digest_numpy(array).startswith("bits128v1:") and len(bits128.digest_numpy(array)) == 10 + 32
    assert steps.digest_as("xxh3_128", array) != steps.digest_as("bits128v1", array)
    with pytest.raises(ValueError, match="no digest algorithm 'md5'"):
        steps.digest_as("md5", array)


def test_torch_digests_several_tensors_with_one_host_copy():
    arrays = [values(dtype, 33, seed) for seed, dtype in enumerate(DTYPES)]
    assert torch_digest.digests([as_torch(a) for a in arrays]) == [bits128.digest_numpy(a) for a in arrays]
    assert torch_digest.digests([]) == []
    with pytest.raises(ValueError, match="a tensor on meta among tensors on cpu"):
        torch_digest.digests([as_torch(arrays[0]), torch.empty(3, device="meta")])


def digested_then_zeroed(device: str = "cpu") -> tuple[list, list[str]]:
    """Three tensors digested when handed over (``digest_now``), then all five zeroed in place (as clipping scales a
    gradient after the recorder took it): the items a writer gets, and the digests they must give."""
    arrays = [values(dtype, 33, seed) for seed, dtype in enumerate(DTYPES)]
    tensors = [as_torch(a).to(device) for a in arrays]
    early = torch_digest.digest_now({f"t{i}": t for i, t in enumerate(tensors[:3])})
    for tensor in tensors:
        tensor.zero_()
    expected = [bits128.digest_numpy(a) for a in arrays[:3]] + [bits128.digest_numpy(np.zeros_like(a))
                                                               for a in arrays[3:]]
    return [*early.values(), *tensors[3:]], expected


def test_a_tensor_digested_when_handed_over_keeps_the_digest_of_its_bits_then():
    items, expected = digested_then_zeroed()
    assert torch_digest.digests(items) == expected
    assert steps.layout(items[0]) == ["bfloat16", [33]] and items[0].nbytes == 66
    assert torch_digest.digest_now({}) == {}


# --- in the step files ------------------------------------------------------------------------------------------------

def _numpy_device_digests(tensors):
    """A GPU run's writer, on numpy arrays: bits128v1 of each (what harness.runners.torch.digest gives on a GPU)."""
    return [bits128.digest_numpy(t) for t in tensors]


def _writer(folder, kept=(), rank=0, device=False):
    return steps.StepWriter(folder, kept, lambda t, path, meta: save_file(t, path, meta),
                            lambda a: np.ascontiguousarray(a).view(np.uint8), rank,
                            digests=_numpy_device_digests if device else None)


def test_a_gpu_runs_writer_writes_device_digests_and_the_validation_accepts_them(tmp_path):
    states = {"param.w": values("float32", (4, 3)), "exp_avg.w": values("float32", 5, 1)}
    _writer(tmp_path / "gpu", device=True).write(1, {"lr": np.zeros((), np.float64)}, states)
    header = steps.read_header(steps.step_file(tmp_path / "gpu", 1))
    assert header.digests == {f"step1.{n}": bits128.digest_numpy(v) for n, v in states.items()}
    assert header.digest_layouts["step1.param.w"] == ["float32", [4, 3]]
    _writer(tmp_path / "cpu").write(1, {"lr": np.zeros((), np.float64)}, states)
    assert all(d.startswith("xxh3_128:") for d in steps.read_header(steps.step_file(tmp_path / "cpu", 1))
               .digests.values())


def test_the_comparator_checks_a_kept_tensor_in_the_other_sides_algorithm_and_refuses_two_algorithms(tmp_path):
    from harness.case.specs import TensorSpec
    from harness.compare.result import decide
    from harness.compare.train_steps import UNCOMPARABLE, _compare_step
    from harness.run.orchestrate import SideResult

    tensor = values("float32", (2, 3))
    other = tensor.copy()
    other[1, 2] = np.nextafter(other[1, 2], np.float32(9))

    def side(name, value, kept=(), device=False):
        _writer(tmp_path / name, kept, device=device).write(1, {}, {"param.w": value})
        return SideResult(name, "double", "ok", tmp_path / name, "python")

    spec = [TensorSpec("step1.param.w", (2, 3), "output", "float32")]
    gpu, gpu_other = side("gpu", tensor, device=True), side("gpu_other", other, device=True)
    kept, cpu = side("kept", tensor, kept=(1,)), side("cpu", tensor)
    assert _compare_step(1, spec, [gpu, gpu])[0].status == "EQUAL"
    assert _compare_step(1, spec, [gpu, gpu_other])[0].status == "DIFF"
    assert _compare_step(1, spec, [kept, gpu])[0].status == "EQUAL"  # bits128v1 of the kept tensor, on the host
    assert _compare_step(1, spec, [gpu_other, kept])[0].status == "DIFF"
    assert _compare_step(1, spec, [kept, cpu])[0].status == "EQUAL"
    refused = _compare_step(1, spec, [cpu, gpu])[0]
    assert refused.status == UNCOMPARABLE and "side a digested it with xxh3_128, side b with bits128v1" in refused.note
    verdict, why = decide([], [refused])
    assert verdict == "ERROR" and "UNCOMPARABLE" in why


def test_validation_refuses_a_digest_of_an_unknown_algorithm(tmp_path):
    from tests.support.cases import registry_from
    from tests.support.train import TINY_TRAIN, tiny_train_case

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 1, "decay_steps": 1,
                                                          "steps_kept": "none"})).get("tiny_train")
    from harness.case.ops import train_step_outputs

    specs = train_step_outputs(case.config["model"], case.train, 1)
    tensors = {s.name.split(".", 1)[1]: np.zeros(s.shape, np.float64 if s.dtype == "float64" else np.float32)
               for s in specs}
    _writer(tmp_path / "side", device=True).write(1, {k: v for k, v in tensors.items() if "." not in k},
                                                  {k: v for k, v in tensors.items() if "." in k})
    assert steps.validate(tmp_path / "side", case) == ""
    path = steps.step_file(tmp_path / "side", 1)
    header = steps.read_header(path)
    renamed = {name: "md5:" + value.split(":", 1)[1] for name, value in header.digests.items()}
    save_file(load_file(str(path)), str(path), {"kept": "false", "digests": json.dumps(renamed),
                                                 "layouts": json.dumps(header.digest_layouts)})
    assert "is not xxh3_128 or bits128v1 ('md5:" in steps.validate(tmp_path / "side", case)


def test_the_ranks_check_reads_device_digests(tmp_path):
    """A GPU run's other ranks digest on their GPU: rank 0's kept tensor (or its digests of their places) is checked in
    bits128v1 too; a rank whose digests name another algorithm than rank 0's is a problem, not a departure."""
    from tests.support.cases import registry_from
    from tests.support.train import TINY_TRAIN, tiny_train_case

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 1, "decay_steps": 1})) \
        .get("tiny_train")
    canonical = np.arange(6, dtype=np.float32)
    changed = canonical.copy()
    changed[4] = np.nextafter(changed[4], np.float32(9))

    def run(name, kept, rank1, piece=None, device1=True):
        for rank, state in enumerate([{"param.w": canonical, "exp_avg.w": canonical}, rank1]):
            pieces = {"exp_avg.w": [(3, 6, (canonical if rank == 0 else piece)[3:6])]} if piece is not None else None
            _writer(tmp_path / name, kept, rank, device=device1 if rank else True).write(
                1, {"lr": np.array(1e-3)}, state, pieces)
        return steps.ranks_agree(tmp_path / name, case, 2)

    for kept in [(1,), ()]:
        same = run(f"same{kept}", kept, {"param.w": canonical}, canonical)
        assert same["departures"] == {} and same["checked"] == 3, kept
        off = run(f"off{kept}", kept, {"param.w": changed}, changed)
        assert off["differing"] == ["step1.param.w (rank 1)", "step1.exp_avg.w[3:6] (rank 1)"], kept
    mixed = run("mixed", (), {"param.w": canonical}, device1=False)
    assert "digests step1.param.w with xxh3_128" in mixed["problem"] and "with bits128v1" in mixed["problem"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_on_the_gpu_torch_gives_the_host_references_bits(monkeypatch):
    """On the GPU, the fused Triton kernel (the runners' path there) and torch's ops: every dtype and layout, a tensor
    over several blocks and chunks, and only the lane sums copied."""
    assert "Triton" in torch_digest.implementation(torch.device("cuda"))  # torch's CUDA builds bring Triton
    for dtype in DTYPES:
        for size in (*SIZES, (300, 7)):
            array = values(dtype, size)
            assert torch_digest.digest(as_torch(array).cuda()) == bits128.digest_numpy(array), (dtype, size)
        array = values(dtype, 3_000_001)
        on_gpu = as_torch(array).cuda()
        expected = bits128.digest_numpy(array)
        assert bits128.finish(torch_digest.lane_sums(on_gpu, chunk=1 << 18).tolist(), array.nbytes) == expected
        assert torch_digest.digest(on_gpu) == expected
        assert torch_digest.digest(on_gpu.reshape(-1)[3:]) == bits128.digest_numpy(array.reshape(-1)[3:])
    arrays = [values(dtype, size, seed) for seed, dtype in enumerate(DTYPES) for size in SIZES]  # a step's mix
    arrays.append(values("float32", 3_000_001))
    expected = [bits128.digest_numpy(a) for a in arrays]
    assert torch_digest.digests([as_torch(a).cuda() for a in arrays]) == expected  # one launch
    monkeypatch.setattr(torch_digest, "FUSED_BATCH_BYTES", 100)  # a launch every few tensors
    assert torch_digest.digests([as_torch(a).cuda() for a in arrays]) == expected
    items, expected = digested_then_zeroed("cuda")
    assert torch_digest.digests(items) == expected and items[0].sums.device.type == "cuda"
    base = as_torch(values("bfloat16", (64, 48))).cuda()
    assert torch_digest.digest(base.T) == torch_digest.digest(base.T.contiguous().cpu())
    assert torch_digest.lane_sums(base).device.type == "cuda"
    if not absent("paddle"):
        import paddle

        from harness.runners.paddle import digest as paddle_digest

        if paddle.device.is_compiled_with_cuda():
            array = values("float32", 100_003)
            assert paddle_digest.digest(paddle.to_tensor(array, place=paddle.CUDAPlace(0))) == \
                bits128.digest_numpy(array)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_on_the_gpu_a_step_digested_beside_the_next_keeps_its_bits_then(tmp_path):
    """OverlappedWrites (the Megatron runner's unkept GPU steps): the state digested on a stream of its own while the
    main stream works on, written at the flush; the file holds the bits the state had at the write, though the main
    stream changes a `moving` tensor at once and the others right after the flush (as the next optimizer step does)."""
    from harness.runners.torch.overlapped_writes import OverlappedWrites
    from harness.runners.torch.train_state import device_digests, host_bytes, save_on_host

    device = torch.device("cuda")
    arrays = {"param.w": values("bfloat16", (4096, 1024)), "exp_avg.w": values("float32", 3_000_001, 1),
              "expert_bias.b": values("float32", 64, 2)}
    pieces_array = values("float32", 1000, 3)
    states = {name: as_torch(a).to(device) for name, a in arrays.items()}
    piece = as_torch(pieces_array).to(device)
    grads = torch_digest.digest_now({"grad.w": as_torch(values("float32", (300, 7), 4)).to(device)})
    writer = steps.StepWriter(tmp_path, (), save_on_host, host_bytes, digests=device_digests(device))
    writes = OverlappedWrites(writer, device)
    assert writes.stream is not None
    scalars = {"lr": torch.zeros((), dtype=torch.float64, device=device)}
    writes.write(1, scalars, {**grads, **states}, {"exp_avg.v": [(0, 1000, piece)]},
                 moving=frozenset({"expert_bias.b"}))
    states["expert_bias.b"].add_(1.0)  # the next backward's routing-bias update, queued at once
    work = torch.randn(4096, 4096, device=device)
    for _ in range(20):  # the next step's forward and backward
        work = work @ work / 64
    assert not steps.step_file(tmp_path, 1).exists()  # written at the flush, not before
    writes.flush()
    for tensor in (*states.values(), piece):  # the optimizer's step, after the flush
        tensor.zero_()
    header = steps.read_header(steps.step_file(tmp_path, 1))
    assert header.digests == {**{f"step1.{n}": bits128.digest_numpy(a) for n, a in arrays.items()},
                              "step1.grad.w": bits128.digest_numpy(values("float32", (300, 7), 4))}
    assert header.pieces["step1.exp_avg.v"][0][3] == bits128.digest_numpy(pieces_array)
