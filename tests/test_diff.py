"""`python -m harness diff` on dumps written by torch, by Paddle and by numpy, bf16 included.

The frameworks write their files in subprocesses (the comparator's process stays framework-free), from
bit patterns made here, so what each file must hold is known exactly.
"""

import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from harness.cli import main
from tests.support.installed import require

BF16 = ml_dtypes.bfloat16
RNG = np.random.default_rng(7)
OUT = RNG.standard_normal((16, 48)).astype(BF16)
WEIGHT = (RNG.standard_normal((48, 64)) * 0.02).astype(BF16)  # Megatron layout [out, in]
GRAD = RNG.standard_normal((16, 64)).astype(np.float32)

TORCH_WRITER = """
import sys, numpy as np, torch
from safetensors.torch import save_file
src = np.load(sys.argv[1])
bf16 = lambda name: torch.from_numpy(src[name].view(np.int16)).view(torch.bfloat16)
save_file({"out": bf16("out"), "weight": bf16("weight"), "grad": torch.from_numpy(src["grad"])}, sys.argv[2])
"""
PADDLE_WRITER = """
import sys, numpy as np, paddle
from safetensors.paddle import save_file
src = np.load(sys.argv[1])
weight = paddle.to_tensor(np.ascontiguousarray(src["weight"].T))  # Paddle layout [in, out]
for key, stem in (("out", "paddle"), ("out_flipped", "paddle_flipped")):
    out = paddle.to_tensor(src[key])                # uint16 bits -> paddle.bfloat16
    assert out.dtype == paddle.bfloat16, out.dtype
    tensors = {"linear.out": out, "linear.weight": weight, "linear.grad": paddle.to_tensor(src["grad"])}
    save_file(tensors, f"{sys.argv[2]}/{stem}.safetensors")
    np.save(f"{sys.argv[2]}/{stem}_out.npy", out.numpy())  # what alignment scripts dump: uint16 bits for bf16
"""


def write_with(script, tmp_path, *targets):
    flipped = OUT.view(np.uint16).copy()
    flipped[5, 9] ^= 1 << 3
    source = tmp_path / "source.npz"
    np.savez(source, out=OUT.view(np.uint16), out_flipped=flipped, weight=WEIGHT.view(np.uint16), grad=GRAD)
    done = subprocess.run([sys.executable, "-c", script, str(source), *map(str, targets)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    require("torch")
    require("paddle")
    root = tmp_path_factory.mktemp("dumps")
    write_with(TORCH_WRITER, root, root / "torch.safetensors")
    write_with(PADDLE_WRITER, root, root)
    (root / "names.toml").write_text('out = "linear.out"\nweight = "linear.weight"\ngrad = "linear.grad"\n')
    (root / "names.json").write_text(json.dumps({"out": "linear.out", "weight": "linear.weight",
                                                  "grad": "linear.grad"}))
    return root


def run(tmp_path, *argv):
    reports = tmp_path / "reports"
    before = set(reports.iterdir()) if reports.exists() else set()
    code = main(["diff", *map(str, argv), "--reports", str(reports)])
    [run_dir] = set(reports.iterdir()) - before
    return code, json.loads((run_dir / "report.json").read_text()), run_dir


@pytest.mark.parametrize("name_map", ["names.toml", "names.json"])
def test_torch_against_paddle_with_name_and_layout_maps_is_bitwise(dumps, tmp_path, name_map):
    code, report, run_dir = run(tmp_path, dumps / "torch.safetensors", dumps / "paddle.safetensors",
                                "--name-map", dumps / name_map, "--layout", "weight=transpose")
    assert (code, report["verdict"]) == (0, "BITWISE_PASS"), report["message"]
    assert {t["name"]: t["dtype"] for t in report["tensors"]} == {"out": "bfloat16", "weight": "bfloat16",
                                                                  "grad": "float32"}
    assert report["harness"]["comparator_memory"]["peak_traced_bytes"] >= WEIGHT.nbytes
    assert (run_dir / "report.md").exists() and (run_dir / "report.html").exists()


def test_without_the_layout_map_the_weight_is_a_shape_mismatch(dumps, tmp_path):
    code, report, _ = run(tmp_path, dumps / "torch.safetensors", dumps / "paddle.safetensors",
                          "--name-map", dumps / "names.toml")
    assert (code, report["verdict"]) == (2, "ERROR")
    assert "weight: SHAPE_MISMATCH (shape [48, 64] vs [64, 48])" in report["message"]


def test_a_flipped_bit_in_paddles_dump_is_found_and_pictured(dumps, tmp_path):
    code, report, run_dir = run(tmp_path, dumps / "torch.safetensors", dumps / "paddle_flipped.safetensors",
                                "--name-map", dumps / "names.toml", "--layout", "weight=transpose")
    assert (code, report["verdict"]) == (1, "DIFF")
    [out] = [t for t in report["tensors"] if t["status"] == "DIFF"]
    assert (out["name"], out["mismatches"], out["first_mismatch"]["index"]) == ("out", 1, [5, 9])
    assert out["max_ulp"] == 8 and out["mismatch_map"]["cells_with_mismatches"] == 1
    assert "](pictures/out.map.png)" in (run_dir / "report.md").read_text()
    assert (run_dir / "pictures" / "out.map.png").read_bytes()[:4] == b"\x89PNG"
    assert "data:image/png;base64," in (run_dir / "report.html").read_text()


def test_numpy_folders_bf16_as_ml_dtypes_and_as_paddle_uint16_bits(dumps, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    (ours / "layer0").mkdir(parents=True)
    (theirs / "layer0").mkdir(parents=True)
    np.save(ours / "layer0" / "out.npy", OUT)  # ml_dtypes bf16: numpy stores raw 2-byte records (|V2)
    (theirs / "layer0" / "out.npy").write_bytes((dumps / "paddle_out.npy").read_bytes())  # uint16 bits
    code, report, _ = run(tmp_path, ours, theirs, "--as-dtype", "bfloat16")
    assert (code, report["verdict"]) == (0, "BITWISE_PASS"), report["message"]
    assert [t["name"] for t in report["tensors"]] == ["layer0/out"]
    code, report, _ = run(tmp_path, ours, theirs)
    assert (code, report["verdict"]) == (2, "ERROR") and "DTYPE_MISMATCH" in report["message"]
    (theirs / "layer0" / "out.npy").write_bytes((dumps / "paddle_flipped_out.npy").read_bytes())
    code, report, _ = run(tmp_path, ours, theirs, "--as-dtype", "layer0/out=bfloat16")
    assert (code, report["tensors"][0]["first_mismatch"]["index"]) == (1, [5, 9])


def test_folder_of_safetensors_against_torch_file_and_a_missing_tensor(dumps, tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    save_file({"out": OUT}, str(folder / "a.safetensors"))
    save_file({"weight": WEIGHT}, str(folder / "b.safetensors"))
    code, report, _ = run(tmp_path, folder, dumps / "torch.safetensors")
    assert (code, report["verdict"]) == (2, "ERROR")
    statuses = {t["name"]: t["status"] for t in report["tensors"]}
    assert statuses == {"out": "EQUAL", "weight": "EQUAL", "grad": "MISSING"}
    assert "has no tensor 'grad'" in report["message"]


def test_bad_inputs_are_named(tmp_path, capsys):
    bad = tmp_path / "names.json"
    bad.write_text('{"out": 3}')
    assert main(["diff", str(tmp_path), str(tmp_path), "--name-map", str(bad)]) == 2
    assert "names.json: field 'out'" in capsys.readouterr().err
    assert main(["diff", "a", "b", "--layout", "w=rotate"]) == 2
    assert "'rotate' is not one of transpose" in capsys.readouterr().err
    code, report, _ = run(tmp_path, tmp_path / "nowhere", tmp_path)
    assert (code, report["verdict"]) == (2, "ERROR") and "nowhere: no such file or folder" in report["message"]
