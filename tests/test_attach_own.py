"""A model the harness has no family record of, recorded in a user's loop (issue 42, item 3; docs/attach.md "Any
model"): tests/support/hook_dump_loops.py's tiny embedding-MLP-norm-head model on real torch and Paddle, float32, CPU,
2 AdamW steps of 2 micro-batches, each run in its own process, recorded with ``model_config={"family": "own"}``.

- Two torch runs in the model's own names compare with no map: BITWISE_PASS, exit 0, module outputs too.
- One ULP planted in ``mlp.down``'s output at step 2, micro-batch 0 (``modules_at=[2]``) is named there; one ULP
  planted in ``mlp.up.weight``'s gradient at step 2 is the first divergence, ``step2.grad.mlp.up.weight``.
- The Paddle model under other names, recorded through a map file, equals the plain Paddle model recorded in its own
  names; through a map that also transposes Paddle's [in, out] weights it holds the torch run's tensors, names and
  shapes, and its module outputs, so the two stacks are compared tensor by tensor and module by module.
- The Paddle recorder's ``modules_at`` (issue 42, item 2): one ULP planted in ``mlp.act``'s output at step 2,
  micro-batch 1 is named there.
- A map's {L} patterns are filled from the model's names, in natural order (layers.10 after layers.2).
- Fail closed: a map without the stack's section, a rule of another kind, a name the model lacks, a trained
  parameter the map leaves unnamed (torch and Paddle) are each an AttachError naming the file, field and value.
"""

import json
import subprocess
import sys

import pytest

from harness.attach.torch import AttachError, StepRecorder
from harness.commands.compare_runs import compare_runs
from harness.run.orchestrate import REPO_ROOT, runner_env
from tests.support.hook_dump_loops import paddle_model, torch_model
from tests.support.installed import absent

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(absent("paddle"), reason="needs paddle")]
LOOPS = REPO_ROOT / "tests" / "support" / "hook_dump_loops.py"
RENAMED = {"embed.weight": "embedding.weight", "mlp.up.weight": "ffn.fc_in.weight", "mlp.up.bias": "ffn.fc_in.bias",
           "mlp.down.weight": "ffn.fc_out.weight", "mlp.down.bias": "ffn.fc_out.bias",
           "norm.weight": "final_norm.weight", "norm.bias": "final_norm.bias", "head.weight": "lm_head.weight"}
TRANSPOSED = ("mlp.up.weight", "mlp.down.weight", "head.weight")  # Paddle's Linear weights are [in, out]
MODULES = {"embed": "embedding", "mlp.up": "ffn.fc_in", "mlp.act": "ffn.tanh", "mlp.down": "ffn.fc_out",
           "norm": "final_norm", "head": "lm_head"}  # the renamed model's modules (modules_at)
RUNS = {"torch": ["torch", "--modules-at", "2"], "torch-again": ["torch", "--modules-at", "2"],
        "torch-planted": ["torch", "--modules-at", "2", "--plant", "mlp.down", "3"],
        "torch-planted-grad": ["torch", "--plant-grad", "mlp.up.weight", "2"],
        "torch-plain": ["torch"], "paddle": ["paddle"],
        "paddle-renamed": ["paddle", "--renamed", "--name-map", "{root}/renamed.toml"],
        "paddle-as-torch": ["paddle", "--renamed", "--name-map", "{root}/as-torch.toml", "--modules-at", "2"],
        "paddle-modules": ["paddle", "--modules-at", "2"],
        "paddle-modules-planted": ["paddle", "--modules-at", "2", "--plant", "mlp.act", "4"]}


def map_file(path, section: str, transposed=(), modules=False) -> None:
    lines = [f"[{section}.grads]"]
    lines += [f'"{name}" = {{ transpose = "{theirs}" }}' if name in transposed else f'"{name}" = "{theirs}"'
              for name, theirs in RENAMED.items()]
    if modules:
        lines += [f"[{section}.modules]", *(f'"{name}" = "{theirs}"' for name, theirs in MODULES.items())]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("own")
    map_file(root / "renamed.toml", "paddle")
    map_file(root / "as-torch.toml", "paddle", TRANSPOSED, modules=True)
    for name, args in RUNS.items():
        args = [arg.format(root=root) for arg in args]
        done = subprocess.run([sys.executable, str(LOOPS), args[0], str(root / name), "--unhooked", "--record",
                               str(root / name / "run"), *args[1:]],
                              env=runner_env("cpu"), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    return root


def compare(tmp_path, root, a, b):
    result, run_dir = compare_runs(root / a / "run", root / b / "run", reports_dir=tmp_path)
    return result, json.loads((run_dir / "report.json").read_text())


def test_two_runs_in_the_models_own_names_pass_with_no_map(runs, tmp_path):
    meta = json.loads((runs / "torch" / "run" / "meta.json").read_text())
    assert meta["capture"]["config"]["model"]["family"] == "own"
    assert [name for name, _ in meta["capture"]["config"]["model"]["parameters"]] == sorted(RENAMED)
    result, report = compare(tmp_path, runs, "torch", "torch-again")
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message
    assert "module outputs bitwise equal at steps 2" in result.message
    assert sum(t["name"].startswith("step2.module.") for t in report["tensors"]) == 2 * (6 + 6)  # mb x (out, grad)


def test_a_planted_bit_in_a_modules_output_is_named_at_that_module_and_step(runs, tmp_path):
    result, report = compare(tmp_path, runs, "torch", "torch-planted")
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    first = report["train"]["modules"]["first_divergence"]
    assert (first["module"], first["quantity"], first["step"], first["micro_batch"]) == ("mlp.down", "output", 2, 0)
    assert "first divergent module: mlp.down (output) at step 2, micro-batch 0" in result.message
    before = {"step2.module.mb0.module.embed", "step2.module.mb0.module.mlp.up", "step2.module.mb0.module.mlp.act"}
    assert {t["name"]: t["status"] for t in report["tensors"] if t["name"] in before} == dict.fromkeys(before, "EQUAL")
    assert [s["verdict"] for s in report["train"]["steps"]][0] == "BITWISE_PASS"


def test_a_planted_bit_in_a_gradient_is_the_first_divergence_at_its_step(runs, tmp_path):
    result, report = compare(tmp_path, runs, "torch-plain", "torch-planted-grad")
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    assert report["train"]["first_divergence"] == {"step": 2, "quantity": "grad",
                                                   "tensor": "step2.grad.mlp.up.weight"}
    differing = [t["name"] for t in report["tensors"] if t["status"] != "EQUAL" and t["name"].startswith("step2.grad")]
    assert differing == ["step2.grad.mlp.up.weight"]


def test_paddle_under_other_names_through_a_map_equals_paddle_in_its_own_names(runs, tmp_path):
    result, _ = compare(tmp_path, runs, "paddle", "paddle-renamed")
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, result.message


def test_a_map_that_transposes_paddles_weights_gives_the_torch_runs_tensors(runs, tmp_path):
    result, report = compare(tmp_path, runs, "torch", "paddle-as-torch")
    rows = {t["name"]: t["status"] for t in report["tensors"]}
    steps = [name for name in rows if not name.startswith("step2.module.")]
    assert len(steps) == 2 * (2 + 4 * 8) and len(rows) - len(steps) == 2 * (6 + 6)  # lr, loss, 4 per parameter
    assert set(rows.values()) <= {"EQUAL", "DIFF"}  # every tensor and module output held by both, same shape
    # compared, not refused; which verdict is the CPU's (tanh's kernels), so the one the rows give (this CPU: DIFF)
    verdict = "DIFF" if "DIFF" in rows.values() else "BITWISE_PASS"
    assert (result.verdict, result.exit_code) == (verdict, {"DIFF": 1, "BITWISE_PASS": 0}[verdict]), result.message


def test_the_paddle_recorder_names_a_planted_bit_in_a_modules_output(runs, tmp_path):
    result, report = compare(tmp_path, runs, "paddle-modules", "paddle-modules-planted")
    assert result.verdict == "DIFF" and result.exit_code == 1, result.message
    first = report["train"]["modules"]["first_divergence"]
    assert (first["module"], first["quantity"], first["step"], first["micro_batch"]) == ("mlp.act", "output", 2, 1)
    before = {"step2.module.mb1.module.embed", "step2.module.mb1.module.mlp.up"}
    assert {t["name"]: t["status"] for t in report["tensors"] if t["name"] in before} == dict.fromkeys(before, "EQUAL")


@pytest.mark.parametrize(("text", "expected"), [
    ("[paddle.grads]\n'embed.weight' = 'embed.weight'\n", "no section [torch] (sections: paddle)"),
    ("[torch.grads]\n'embed.weight' = { stack = 'embed.weight' }\n",
     "[torch.grads] 'embed.weight' = {'stack': 'embed.weight'}: a rule here is a name or one of"),
    ("[torch.grads]\n'embed.weight' = 'embedding.weight'\n",
     "[torch.grads] 'embed.weight' = 'embedding.weight': the model has no parameter 'embedding.weight'"),
    ("[torch.grads]\n'embed.weight' = 'embed.weight'\n",
     "trained parameters mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias, norm.weight ... (7)"),
    ("[torch.grads]\n'embed.weight' = 'embed.weight'\n[torch.layers]\n", "[torch.layers]: no such table"),
    ("[torch.grads\n", "not TOML"),
])
def test_a_bad_map_file_is_refused_naming_the_file_field_and_value(tmp_path, text, expected):
    import torch

    path = tmp_path / "map.toml"
    path.write_text(text)
    model = torch_model(False)
    with pytest.raises(AttachError) as raised:
        StepRecorder(tmp_path / "run", model, torch.optim.AdamW(model.parameters()),
                     {"family": "own", "name_map": str(path)})
    assert str(path) in str(raised.value) and expected in str(raised.value)


def test_a_paddle_parameter_the_map_leaves_unnamed_is_refused(tmp_path):
    import paddle

    from harness.attach.paddle import PaddleStepRecorder

    path = tmp_path / "map.toml"
    path.write_text("[paddle.grads]\n'embed.weight' = 'embedding.weight'\n")
    model = paddle_model(True)
    optimizer = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    with pytest.raises(AttachError) as raised:
        PaddleStepRecorder(tmp_path / "run", model, optimizer, {"family": "own", "name_map": str(path)})
    assert "is read by no rule of the name map" in str(raised.value) and str(path) in str(raised.value)


def test_a_maps_layer_patterns_are_filled_from_the_models_names(tmp_path):
    import torch

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 3) for _ in range(11)])
    path = tmp_path / "map.toml"
    path.write_text("[torch.grads]\n'layers.{L}.weight' = { transpose = 'blocks.{L}.weight' }\n"
                    "'layers.{L}.bias' = 'blocks.{L}.bias'\n")
    recorder = StepRecorder(tmp_path / "run", model, torch.optim.AdamW(model.parameters()),
                            {"family": "own", "name_map": str(path)})
    parameters = recorder.m.parameters
    assert len(parameters) == 22 and parameters[:2] == (("layers.0.bias", (3,)), ("layers.0.weight", (2, 3)))
    assert [name for name, _ in parameters][-2:] == ["layers.10.bias", "layers.10.weight"]  # natural order
    assert recorder.states.rules["layers.10.weight"].sources == ("blocks.10.weight",)
