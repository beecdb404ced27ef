"""Per-module md5 dumps as a run (issue 42, item 1): ``compare-runs --hook-dumps`` over dumps written here in the
format of PaddleFleet's ``[DUMP PF]`` lines by hooks on real torch and Paddle models (``harness.attach.dump_hooks``;
tests/support/hook_dump_loops.py: a tiny embedding-MLP-norm-head model, float32, CPU, 2 AdamW steps of 2
micro-batches, each run in its own process).

- The hooks change nothing: the parameters after training equal the unhooked run's bit for bit, on each stack.
- A run against a second run of itself passes, exit 0; one ULP planted in one module's output at one forward is
  located at that module, step and micro-batch (torch: ``mlp.down`` at step 2, micro-batch 0; Paddle, under other
  module names paired through a name map: ``mlp.act`` at step 2, micro-batch 1), exit 1, every record before it equal.
- Two ranks: one ULP planted on rank 1 only is located at rank 1.
- Fail closed: modules with other names and no map, a file of a folder without its rank, a map that misses a module,
  a run cut off inside a step, a call skipped, a line that does not read whole: each an ERROR naming the file, line or
  module.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main
from harness.commands.compare_runs import compare_runs
from harness.run.orchestrate import REPO_ROOT, runner_env
from tests.support.installed import absent

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(absent("paddle"), reason="needs paddle")]
LOOPS = REPO_ROOT / "tests" / "support" / "hook_dump_loops.py"
RUNS = {"torch": ["torch"], "torch-again": ["torch"], "torch-unhooked": ["torch", "--unhooked"],
        "torch-planted": ["torch", "--plant", "mlp.down", "3"],
        "paddle": ["paddle"], "paddle-unhooked": ["paddle", "--unhooked"], "paddle-renamed": ["paddle", "--renamed"],
        "paddle-renamed-planted": ["paddle", "--renamed", "--plant", "ffn.tanh", "4"]}
NAME_MAP = {"embed": "embedding", "mlp.up": "ffn.fc_in", "mlp.act": "ffn.tanh", "mlp.down": "ffn.fc_out",
            "norm": "final_norm", "head": "lm_head", "mlp": "ffn"}  # module in A = module in B


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook-dumps")
    for name, args in RUNS.items():
        done = subprocess.run([sys.executable, str(LOOPS), args[0], str(root / name), *args[1:]],
                              env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    (root / "map.json").write_text(json.dumps(NAME_MAP))
    return root


def compare(tmp_path, a, b, **options):
    result, run_dir = compare_runs(a, b, hook_dumps=True, micro_batches=2, reports_dir=tmp_path, **options)
    return result, json.loads((run_dir / "report.json").read_text())


def bits(folder: Path) -> dict[str, bytes]:
    with np.load(folder / "state.npz") as arrays:
        return {name: arrays[name].tobytes() for name in arrays.files}


@pytest.mark.parametrize("stack", ["torch", "paddle"])
def test_the_dump_hooks_change_nothing(runs, stack):
    assert bits(runs / stack) == bits(runs / f"{stack}-unhooked")


def test_a_run_against_a_second_run_of_itself_passes(runs, tmp_path):
    result, report = compare(tmp_path, runs / "torch" / "dumps", runs / "torch-again" / "dumps")
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert len(report["tensors"]) == 2 * 2 * (6 * 3)  # steps x micro-batches x (modules x output, input, grad)
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "BITWISE_PASS"]


def test_a_planted_bit_in_one_modules_output_is_located_at_that_module_and_step(runs, tmp_path):
    result, report = compare(tmp_path, runs / "torch" / "dumps", runs / "torch-planted" / "dumps")
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    first = report["train"]["first_divergence"]
    assert first == {"step": 2, "quantity": "output", "tensor": "step2.output.rank0.mb0.mlp.down",
                     "module": "mlp.down", "micro_batch": 0, "rank": 0}
    assert result.message.startswith("first divergent module: mlp.down (output) at step 2, micro-batch 0, rank 0")
    names = [t["name"] for t in report["tensors"]]
    before = names[:names.index(first["tensor"])]
    assert "step2.input.rank0.mb0.mlp.down" in before  # the bit is in its output, not in what it was given
    assert all(t["status"] == "EQUAL" for t in report["tensors"] if t["name"] in before)
    assert [s["verdict"] for s in report["train"]["steps"]] == ["BITWISE_PASS", "DIFF"]


def test_paddle_runs_under_other_module_names_pair_through_a_name_map(runs, tmp_path):
    result, _ = compare(tmp_path, runs / "paddle" / "dumps", runs / "paddle-renamed" / "dumps",
                        name_map=runs / "map.json")
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    result, report = compare(tmp_path, runs / "paddle" / "dumps", runs / "paddle-renamed-planted" / "dumps",
                             name_map=runs / "map.json")
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    assert report["train"]["first_divergence"] == {"step": 2, "quantity": "output", "micro_batch": 1, "rank": 0,
                                                   "module": "mlp.act", "tensor": "step2.output.rank0.mb1.mlp.act"}


def test_a_planted_bit_on_one_rank_is_located_at_that_rank(runs, tmp_path):
    folders = {}
    for run, ranks in {"a": ("torch", "torch-again"), "b": ("torch-again", "torch-planted")}.items():
        folders[run] = tmp_path / run
        folders[run].mkdir()
        for rank, source in enumerate(ranks):
            shutil.copy(runs / source / "dumps" / "workerlog.0", folders[run] / f"workerlog.{rank}")
    result, report = compare(tmp_path, folders["a"], folders["b"])
    assert result.verdict == "DIFF", result.message
    assert report["train"]["first_divergence"] == {"step": 2, "quantity": "output", "module": "mlp.down",
                                                   "micro_batch": 0, "rank": 1,
                                                   "tensor": "step2.output.rank1.mb0.mlp.down"}
    (folders["b"] / "workerlog.1").rename(folders["b"] / "extra.log")
    result, _ = compare(tmp_path, folders["a"], folders["b"])
    assert result.verdict == "ERROR" and "extra.log: which rank wrote it?" in result.message


def test_the_command_line_exits_with_the_verdicts_code(runs, tmp_path):
    args = ["compare-runs", str(runs / "torch" / "dumps"), str(runs / "torch-planted" / "dumps"), "--hook-dumps",
            "--micro-batches", "2", "--reports", str(tmp_path)]
    assert main(args) == 1


def test_other_module_names_without_a_map_are_an_error_naming_a_module(runs, tmp_path):
    result, _ = compare(tmp_path, runs / "paddle" / "dumps", runs / "paddle-renamed" / "dumps")
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert "step1.output.rank0.mb0.embed: MISSING (only run A dumps it" in result.message


def test_a_map_that_misses_a_module_is_an_error_naming_it_and_the_map(runs, tmp_path):
    partial = tmp_path / "partial.toml"
    partial.write_text("".join(f'"{a}" = "{b}"\n' for a, b in NAME_MAP.items() if a != "norm"))
    result, _ = compare(tmp_path, runs / "paddle" / "dumps", runs / "paddle-renamed" / "dumps", name_map=partial)
    assert result.verdict == "ERROR"
    assert f"module 'final_norm' of run B is in no entry of the name map {partial}" in result.message


def edited(runs, tmp_path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(runs / "torch" / "dumps", copy)
    log = copy / "workerlog.0"
    log.write_text("\n".join(edit(log.read_text().splitlines())) + "\n")
    return copy


def test_a_run_cut_off_inside_a_step_is_an_error(runs, tmp_path):
    cut = edited(runs, tmp_path, lambda lines: lines[:-18])  # step 2's second micro-batch's records gone
    result, _ = compare(tmp_path, runs / "torch" / "dumps", cut)
    assert result.verdict == "ERROR"
    assert "was dumped 3 times, not a whole number of steps of 2 micro-batches" in result.message


def test_a_skipped_call_or_a_line_that_does_not_read_whole_is_an_error_naming_its_line(runs, tmp_path):
    skipped = edited(runs, tmp_path, lambda lines: [lines[0].replace("step1 ", "step2 "), *lines[1:]])
    result, _ = compare(tmp_path, runs / "torch" / "dumps", skipped)
    assert result.verdict == "ERROR"
    assert "workerlog.0:1: forward embed/input is call 2 after call 0" in result.message
    shutil.rmtree(skipped)
    cut = edited(runs, tmp_path, lambda lines: [lines[0][:60], *lines[1:]])
    result, _ = compare(tmp_path, runs / "torch" / "dumps", cut)
    assert result.verdict == "ERROR"
    assert "workerlog.0:1: a [DUMP] record that does not read as" in result.message
