"""Checkpoints: deterministic, reused, verified; imported weights keep their bits."""

import json

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
    assert first.folder == again.folder
    assert first.path.read_bytes() == elsewhere.path.read_bytes()
    tensors = checkpoints.load_tensors(first.path)
    assert {k: (v.dtype.name, v.shape) for k, v in tensors.items()} == {
        "input": ("bfloat16", (4, 6)), "weight": ("bfloat16", (8, 6)), "grad_output": ("bfloat16", (4, 8))}
    assert 0.005 < float(tensors["weight"].astype(np.float32).std()) < 0.05  # std 0.02 by default
    assert first.manifest["tensors"]["weight"]["sha256"] == checkpoints.tensor_sha256(tensors["weight"])


def test_other_tokens_give_another_checkpoint(registry, tmp_path):
    a = checkpoints.prepare(registry.get("fc1"), tmp_path)
    b = checkpoints.prepare(registry.get("fc1").with_tokens(5), tmp_path)
    assert a.folder != b.folder


def test_corruption_is_an_error_never_a_regeneration(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1"), tmp_path)
    data = bytearray(checkpoint.path.read_bytes())
    data[-1] ^= 0x01
    checkpoint.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"tensor '\w+' has sha256 .* changed or corrupted"):
        checkpoints.prepare(registry.get("fc1"), tmp_path)
    assert checkpoint.path.read_bytes() == bytes(data)  # left as found


def test_perturbed_side_differs_in_exactly_one_bit(registry, tmp_path):
    checkpoint = checkpoints.prepare(registry.get("fc1_flip"), tmp_path)
    shared = checkpoints.load_tensors(checkpoint.path_for("a"))
    flipped = checkpoints.load_tensors(checkpoint.path_for("b"))
    delta = shared["weight"].view(np.uint16) ^ flipped["weight"].view(np.uint16)
    assert np.flatnonzero(delta).tolist() == [2 * 6 + 3] and int(delta[2, 3]) == 1 << 6
    for name in ("input", "grad_output"):
        assert np.array_equal(shared[name].view(np.uint16), flipped[name].view(np.uint16))


def test_weights_import_concatenates_hf_tensors(registry, tmp_path):
    gate = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    up = -gate
    source = tmp_path / "model.safetensors"
    save_file({"layers.1.gate_proj.weight": gate, "layers.1.up_proj.weight": up}, str(source))
    checkpoint = checkpoints.prepare(registry.get("fc1_hf"), tmp_path / "ck", weights_file=str(source))
    weight = checkpoints.load_tensors(checkpoint.path)["weight"]
    assert np.array_equal(weight.view(np.uint16), np.concatenate([gate, up]).view(np.uint16))
    recipe = json.loads((checkpoint.folder / "manifest.json").read_text())["recipe"]
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
    import subprocess
    import sys

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
    [case_dir] = (tmp_path / "ck").iterdir()
    assert [p.name for p in case_dir.iterdir()] == [checkpoints.Path(folders.pop()).name]  # no staging leftovers
    checkpoints.verify(case_dir / next(case_dir.iterdir()).name)
