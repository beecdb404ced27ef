"""Checkpoints: deterministic, weights shared across token counts and cases, reused, verified; imported weights keep
their bits."""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from harness.case import checkpoints
from harness.case.checkpoints import CheckpointError
from harness.case.registry import Registry
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
