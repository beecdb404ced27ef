"""Checkpoints: deterministic, weights shared across token counts and cases, reused, verified; imported weights keep
their bits."""

import json
import subprocess
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from harness.case import checkpoints, generate, tensorfile
from harness.case.checkpoints import CheckpointError
from harness.case.registry import CaseError, Registry
from harness.run.protocol import read_checkpoint
from tests.support.cases import tiny_case, write_cases

REGISTRY_TABLES = (
    tiny_case("fc1", dtype="bfloat16", seed=7, shapes={"input_size": 6, "output_size": 8}),
    tiny_case("fc1_flip", base="fc1", perturb={"side": "b", "tensor": "weight", "index": [2, 3], "bit": 6}),
    tiny_case("fc1_flip_input", base="fc1", perturb={"side": "a", "tensor": "grad_output", "index": [1, 2], "bit": 3}),
    tiny_case("fc1_gate_off", base="fc1", config={"use_accuracy_compatible": False}),
    tiny_case("fc1_seed8", base="fc1", seed=8),
    tiny_case("fc1_hf", base="fc1",
              weights_from={"tensors": {"weight": ["layers.1.gate_proj.weight", "layers.1.up_proj.weight"]}}),
)


@pytest.fixture
def registry(tmp_path):
    return Registry.load(write_cases(tmp_path, *REGISTRY_TABLES))


def test_generation_is_deterministic_and_reused(registry, tmp_path):
    first = checkpoints.prepare(registry.get("fc1"), tmp_path / "a")
    again = checkpoints.prepare(registry.get("fc1"), tmp_path / "a")
    elsewhere = checkpoints.prepare(registry.get("fc1"), tmp_path / "b")
    assert (first.folder, first.weights) == (again.folder, again.weights)
    assert [f.read_bytes() for f in first.files] == [f.read_bytes() for f in elsewhere.files]
    tensors = first.tensors()
    assert {k: (v.dtype.name, v.shape) for k, v in tensors.items()} == {
        "input": ("bfloat16", (4, 6)), "weight": ("bfloat16", (8, 6)), "grad_output": ("bfloat16", (4, 8))}
    assert 0.005 < float(tensors["weight"].astype(np.float32).std()) < 0.05  # std 0.02 by default
    weights = json.loads((first.weights / "manifest.json").read_text())
    assert weights["tensors"]["weight"]["sha256"] == checkpoints.tensor_sha256(tensors["weight"])
    assert set(checkpoints.load_tensors(first.path)) == {"input", "grad_output"}  # the token-dependent part


def test_weights_are_shared_by_token_counts_and_cases_with_the_same_weights(registry, tmp_path):
    """One weights file for every token count and every case whose weights' recipe is the same; the case's folder
    and digest still differ wherever any bit does."""
    a = checkpoints.prepare(registry.get("fc1"), tmp_path)
    b = checkpoints.prepare(registry.get("fc1").with_tokens(5), tmp_path)
    gate_off = checkpoints.prepare(registry.get("fc1_gate_off"), tmp_path)
    other_seed = checkpoints.prepare(registry.get("fc1_seed8"), tmp_path)
    assert a.folder != b.folder and a.manifest["digest"] != b.manifest["digest"]
    assert a.weights == b.weights == gate_off.weights != other_seed.weights
    assert len(list((tmp_path / "weights").iterdir())) == 2
    assert np.array_equal(a.tensors()["weight"].view(np.uint16), b.tensors()["weight"].view(np.uint16))


def test_digest_is_the_recipe_of_every_bit_as_before_the_split(registry):
    """What a baseline's record is checked against: a digest of the same recipe as before the weights got a part of
    their own, so a case's records are still its own (the value, pinned, is what the unsplit checkpoint had)."""
    assert checkpoints.digest(registry.get("fc1")) == "fb7e740cb2afde5c"


def test_corruption_is_an_error_never_a_regeneration(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    data = bytearray(checkpoint.path.read_bytes())
    data[-1] ^= 0x01
    checkpoint.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor '\w+' has sha256 .* changed or corrupted"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)
    assert checkpoint.path.read_bytes() == bytes(data)  # left as found


def test_corrupted_weights_are_caught_by_a_new_process_and_by_verify(registry, tmp_path):
    """The weights' sha256 is checked once per process and file: a changed bit is caught by the next process that
    loads them, and by verify (every tensor in full)."""
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    weights = checkpoint.weights / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"weights.safetensors: tensor 'weight' has sha256 .* corrupted"):
        checkpoints.verify(checkpoint.folder)
    code = ("import sys; from pathlib import Path; from harness.case import checkpoints; "
            "from harness.case.registry import Registry; "
            "checkpoints.prepare(Registry.load(Path(sys.argv[1])).get('fc1'), Path(sys.argv[2]))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cases"), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "changed or corrupted" in done.stderr, done.stderr[-2000:]


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    with open(path, "r+b") as out:  # in place: same inode, same size
        out.write(bytes(data))


def test_weights_changed_after_this_process_hashed_them_are_caught_by_their_times(registry, tmp_path, monkeypatch):
    """A remembered hash counts only for the same path, inode, size, mtime and ctime: a change in place moves the
    times, and the next load hashes the file again."""
    monkeypatch.setattr(checkpoints, "SETTLED_NS", 0)  # every hash remembered at once, however recent the file
    checkpoints.prepare(registry.get("fc1"), tmp_path)
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)  # hashed here, remembered
    _flip_last_byte(checkpoint.weights / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"weights.safetensors: tensor 'weight' has sha256 .* corrupted"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)


def test_weights_changed_in_the_tick_of_their_last_write_are_caught(registry, tmp_path, monkeypatch):
    """File times are coarse on many kernels and filesystems (a jiffy, a second): a change in the tick of the write
    before moves neither mtime nor ctime. A file whose times are that recent is hashed on every load, never
    remembered, so such a change is still caught in the process that hashed the file before."""
    real, first_seen = checkpoints._identity, {}

    def coarse_times_double(file):  # named double: a filesystem whose times did not move on a same-tick write
        identity = real(file)
        return first_seen.setdefault(identity[0], identity)

    monkeypatch.setattr(checkpoints, "_identity", coarse_times_double)
    checkpoints.prepare(registry.get("fc1"), tmp_path)
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)  # hashed here, just after the write
    _flip_last_byte(checkpoint.weights / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"weights.safetensors: tensor 'weight' has sha256 .* corrupted"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)


def test_verify_refuses_a_weights_digest_that_leaves_the_weights_folder(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    manifest = json.loads((checkpoint.folder / "manifest.json").read_text())
    (checkpoint.folder / "manifest.json").write_text(json.dumps({**manifest, "weights": "../../fc1"}))
    with pytest.raises(CheckpointError, match=r"manifest.json: key 'weights': weights digest name '../../fc1' "):
        checkpoints.verify(checkpoint.folder)


def test_truncated_weights_are_caught_by_the_cheap_check(registry, tmp_path):
    """Every load checks each file's size and header against its manifest, even in the process that hashed it."""
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    weights = checkpoint.weights / "weights.safetensors"
    weights.write_bytes(weights.read_bytes()[:-2])
    with pytest.raises(CheckpointError, match=r"weights.safetensors: not a readable safetensors file: the header "
                                              r"describes \d+ bytes, the file has \d+"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)


def test_a_manifest_of_the_unsplit_layout_is_refused(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    manifest = json.loads((checkpoint.folder / "manifest.json").read_text())
    (checkpoint.folder / "manifest.json").write_text(json.dumps({**manifest, "schema": 1}))
    with pytest.raises(CheckpointError, match=r"key 'schema' is 1, this harness reads 2 .* delete"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)


def test_perturbed_side_differs_in_exactly_one_bit(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1_flip"), tmp_path)
    shared, flipped = checkpoint.tensors("a"), checkpoint.tensors("b")
    delta = shared["weight"].view(np.uint16) ^ flipped["weight"].view(np.uint16)
    assert np.flatnonzero(delta).tolist() == [2 * 6 + 3] and int(delta[2, 3]) == 1 << 6
    for name in ("input", "grad_output"):
        assert np.array_equal(shared[name].view(np.uint16), flipped[name].view(np.uint16))
    assert checkpoint.files_for("a") == checkpoint.files
    assert checkpoint.files_for("b") == (checkpoint.folder / "weights.b.safetensors", checkpoint.path)
    plain = checkpoints.prepare(registry.get("fc1"), tmp_path)
    assert checkpoint.weights == plain.weights  # the control's shared side reads the case's own weights file


def test_perturbed_input_replaces_the_inputs_part(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1_flip_input"), tmp_path)
    assert checkpoint.files_for("a") == (checkpoint.weights / "weights.safetensors",
                                         checkpoint.folder / "inputs.a.safetensors")
    delta = checkpoint.tensors("a")["grad_output"].view(np.uint16) ^ checkpoint.tensors("b")["grad_output"].view(
        np.uint16)
    assert np.flatnonzero(delta).tolist() == [1 * 8 + 2] and int(delta[1, 2]) == 1 << 3
    checkpoints.verify(checkpoint.folder)  # the flipped copy's manifest entry is its own sha256


def test_weights_import_concatenates_hf_tensors(registry, tmp_path):
    gate = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    up = -gate
    source = tmp_path / "model.safetensors"
    save_file({"layers.1.gate_proj.weight": gate, "layers.1.up_proj.weight": up}, str(source))
    checkpoint = checkpoints.prepare(registry.get("fc1_hf"), tmp_path / "ck", weights_file=str(source))
    weight = checkpoint.tensors()["weight"]
    assert np.array_equal(weight.view(np.uint16), np.concatenate([gate, up]).view(np.uint16))
    recipe = json.loads((checkpoint.weights / "manifest.json").read_text())["recipe"]
    assert recipe["imported"]["weight"]["names"] == ["layers.1.gate_proj.weight", "layers.1.up_proj.weight"]


def test_the_digest_names_the_weights_bytes_not_their_path(registry, tmp_path):
    """Two clones hold one weights file at two paths (CI's checkout is not this one): one digest, so a committed
    baseline recorded in one clone applies in the other; other bytes at the same path give another digest."""
    gate = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    tensors = {"layers.1.gate_proj.weight": gate, "layers.1.up_proj.weight": -gate}
    here, there = tmp_path / "a" / "model.safetensors", tmp_path / "b" / "model.safetensors"
    for path in (here, there):
        path.parent.mkdir()
        save_file(tensors, str(path))
    case = registry.get("fc1_hf")
    assert checkpoints.digest(case, str(here)) == checkpoints.digest(case, str(there))
    save_file({**tensors, "layers.1.up_proj.weight": gate}, str(there))
    assert checkpoints.digest(case, str(here)) != checkpoints.digest(case, str(there))


def test_weights_import_names_a_missing_tensor(registry, tmp_path):
    source = tmp_path / "model.safetensors"
    save_file({"layers.1.gate_proj.weight": np.zeros((4, 6), np.float32)}, str(source))
    with pytest.raises(CheckpointError, match=r"model.safetensors: no tensor 'layers.1.up_proj.weight'"):
        checkpoints.prepare(registry.get("fc1_hf"), tmp_path / "ck", weights_file=str(source))


def test_concurrent_generation_of_one_checkpoint_is_safe(tmp_path):
    """Test workers (pytest -n) and nightly workers may build one checkpoint at once: each writes a staging
    folder and renames it into place (atomic); the loser reuses the winner's files, and nothing is left over."""
    write_cases(tmp_path, tiny_case("fc1_flip", dtype="bfloat16", tokens=512,
                                    shapes={"input_size": 64, "output_size": 64},
                                    perturb={"side": "b", "tensor": "weight", "index": [2, 3], "bit": 6}))
    code = ("import sys; from pathlib import Path; from harness.case import checkpoints; "
            "from harness.case.registry import Registry; "
            "case = Registry.load(Path(sys.argv[1]) / 'cases').get('fc1_flip'); "
            "print(checkpoints.prepare(case, Path(sys.argv[1]) / 'ck').folder)")
    processes = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(6)]
    results = [process.communicate(timeout=120) for process in processes]
    assert all(process.returncode == 0 for process in processes), [err for _, err in results]
    folders = {out.strip() for out, _ in results}
    assert len(folders) == 1
    case_dir, weights_dir = tmp_path / "ck" / "fc1_flip", tmp_path / "ck" / "weights"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["fc1_flip", "weights"]
    assert [p.name for p in case_dir.iterdir()] == [checkpoints.Path(folders.pop()).name]  # no staging leftovers
    assert len(list(weights_dir.iterdir())) == 1
    checkpoints.verify(case_dir / next(case_dir.iterdir()).name)


# ---------------------------------------------------------------- how the bits are made (harness.case.generate)

def _plan(dtype, dist, shape=(5, 40), name="t", seed=11):
    return generate.Plan(name, shape, np.dtype(dtype), seed, dist=dist)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dist", [{"dist": "normal", "mean": 0.5, "std": 0.02},
                                  {"dist": "uniform", "low": -1.0, "high": 3.0}], ids=["normal", "uniform"])
def test_a_tensor_of_one_block_is_one_draw_of_its_stream(monkeypatch, dtype, dist):
    """Version 1's bits: one draw of (seed, crc32 of the name), in float32, rounded once to the dtype; the scratch
    buffer (shrunk here to 7 elements) only continues the stream."""
    monkeypatch.setattr(generate, "SCRATCH", 7)
    plan = _plan(dtype, dist)
    rng = np.random.default_rng([11, zlib.crc32(b"t")])
    if dist["dist"] == "normal":
        expected = rng.standard_normal(plan.shape, dtype=np.float32) * dist["std"] + dist["mean"]
    else:
        expected = rng.uniform(dist["low"], dist["high"], plan.shape).astype(np.float32)
    expected = expected.astype(dtype)
    got = generate.draw(plan)
    assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes()
    assert generate.version([plan]) == 1


def test_a_big_tensor_is_drawn_in_independent_blocks_the_same_on_any_number_of_threads(monkeypatch):
    monkeypatch.setattr(generate, "BLOCK", 64)
    monkeypatch.setattr(generate, "SCRATCH", 10)
    plan = _plan(ml_dtypes.bfloat16, {"dist": "normal", "mean": 0.0, "std": 1.0}, shape=(3, 70))
    whole = generate.draw(plan).reshape(-1)
    first = np.random.default_rng([11, zlib.crc32(b"t")]).standard_normal(64, dtype=np.float32)
    second = np.random.default_rng([11, zlib.crc32(b"t"), 1]).standard_normal(64, dtype=np.float32)
    assert whole[:64].tobytes() == first.astype(ml_dtypes.bfloat16).tobytes()  # block 0: version 1's stream
    assert whole[64:128].tobytes() == second.astype(ml_dtypes.bfloat16).tobytes()  # block 1: its own stream
    assert generate.version([plan]) == 2 and list(plan.blocks()) == [0, 64, 128, 192]
    small = _plan(np.float32, {"dist": "uniform", "low": 0.0, "high": 1.0}, shape=(9,), name="small")
    for workers in (1, 3):
        blocks = [(p, block.copy()) for p, block in generate.blocks_in_order([plan, small], workers)]
        assert [p.name for p, _ in blocks] == ["t"] * 4 + ["small"]
        assert np.concatenate([b for p, b in blocks if p is plan]).tobytes() == whole.tobytes()


def test_bfloat16_rounding_is_ml_dtypes_cast_on_every_kind_of_value():
    """Round to nearest even on the float32 bits, at each rounding edge (low half 0, 1, 0x7fff, 0x8000, 0x8001,
    0xffff), odd and even kept bits, subnormals, the largest finite values (rounding up to infinity) and
    infinities. All finite float32 were checked once against ml_dtypes (0 differences)."""
    rng = np.random.default_rng(0)
    high = np.concatenate([np.arange(0, 0x10000, dtype=np.uint32), rng.integers(0, 0x10000, 4096, dtype=np.uint32)])
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    values = ((high[:, None] << 16) | low[None, :]).reshape(-1).view(np.float32)
    values = values[~np.isnan(values)]
    out = np.empty(values.size, ml_dtypes.bfloat16)
    generate._round_into(values, out)
    assert out.view(np.uint16).tobytes() == values.astype(ml_dtypes.bfloat16).view(np.uint16).tobytes()


def test_checkpoint_files_are_safetensors_with_every_tensor_aligned(registry, tmp_path):
    case = registry.get("fc1").with_tokens(3)
    made = list(generate.plans(case).values())
    described = checkpoints.write_tensors(tmp_path / "x.safetensors", made)
    loaded = load_file(str(tmp_path / "x.safetensors"))
    expected = generate.generate(case)
    assert {k: v.tobytes() for k, v in loaded.items()} == {k: v.tobytes() for k, v in expected.items()}
    assert {k: d["sha256"] for k, d in described.items()} == {k: checkpoints.tensor_sha256(v)
                                                              for k, v in expected.items()}
    header, start = tensorfile.read_header(tmp_path / "x.safetensors")
    assert start % 8 == 0 and all(entry["data_offsets"][0] % 2 == 0 for entry in header.values())


@pytest.mark.parametrize("damage", [lambda b: b[:5], lambda b: b[:-1], lambda b: b + b"x",
                                    lambda b: (2**40).to_bytes(8, "little") + b[8:], lambda b: b[:8] + b"[" + b[9:]],
                         ids=["no header length", "short data", "long data", "huge header", "not json"])
def test_a_damaged_file_is_not_a_readable_safetensors_file(tmp_path, damage):
    save_file({"a": np.arange(6, dtype=np.float32)}, str(tmp_path / "ok.safetensors"))
    (tmp_path / "bad.safetensors").write_bytes(damage((tmp_path / "ok.safetensors").read_bytes()))
    tensorfile.read_header(tmp_path / "ok.safetensors")
    with pytest.raises(tensorfile.BadFile):
        tensorfile.read_header(tmp_path / "bad.safetensors")


def test_a_runner_reads_the_files_of_its_request_as_one_checkpoint(tmp_path):
    save_file({"weight": np.ones(2, np.float32)}, str(tmp_path / "w.safetensors"))
    save_file({"input": np.zeros(3, np.float32)}, str(tmp_path / "i.safetensors"))
    files = [str(tmp_path / "w.safetensors"), str(tmp_path / "i.safetensors")]
    assert sorted(read_checkpoint(files, load_file)) == ["input", "weight"]
    with pytest.raises(ValueError, match=r"i.safetensors: tensor 'input' is also in an earlier checkpoint file"):
        read_checkpoint([*files, files[1]], load_file)
    with pytest.raises(ValueError, match="must be a list of safetensors files"):
        read_checkpoint(files[0], load_file)


def test_no_case_may_take_the_shared_weights_folder_name(tmp_path):
    with pytest.raises(CaseError, match=r"case name 'weights' is taken: checkpoints/weights/ holds the weights"):
        Registry.load(write_cases(tmp_path, tiny_case("weights")))


@pytest.mark.parametrize("threads", [1, 3])
def test_each_tensors_sha256_is_that_of_its_own_bytes_on_any_number_of_threads(tmp_path, monkeypatch, threads):
    import hashlib

    monkeypatch.setattr(tensorfile, "HASH_THREADS", threads)
    rng = np.random.default_rng(5)
    arrays = {f"t{i}": rng.standard_normal(size).astype(np.float32) for i, size in enumerate((3, 70_000, 1, 5_000))}
    arrays["empty"] = np.zeros((0, 4), dtype=np.float32)
    arrays["bf16"] = rng.standard_normal(999).astype(ml_dtypes.bfloat16)
    save_file(arrays, str(tmp_path / "x.safetensors"))
    found = tensorfile.sha256s(tmp_path / "x.safetensors", hashlib.sha256)
    assert list(found) == list(tensorfile.read_header(tmp_path / "x.safetensors")[0])  # the file's order
    assert found == {name: hashlib.sha256(array.tobytes()).hexdigest() for name, array in arrays.items()}
