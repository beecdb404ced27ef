"""The training case (op causal_lm_train) without frameworks: the `train` table's defaults and every refusal (file,
case, field and value named), the op's per-step inputs and outputs, the per-step checkpoint tensors, and the step
files' validation. Runs in about a second."""

import json
from dataclasses import replace

import numpy as np
import pytest

from harness.case.generate import generate
from harness.case.ops import train_state_names
from harness.case.registry import CaseError, Registry
from harness.case.train_settings import parse_steps_kept
from harness.run import steps
from tests.support.cases import registry_from
from tests.support.train import TINY_SGD, TINY_TRAIN, tiny_train_case, whole_steps


def test_the_registry_cases_resolve_every_train_field():
    registry = Registry.load()
    case = registry.get("kimi_k2_2layer_train")
    train = case.train
    assert (train.steps, train.micro_batches, train.master_weights) == (3, 2, False)
    assert train.decay_steps == 3 and train.steps_kept == (1, 2, 3) and train.flip is None
    assert train.record.name == "adamw" and train.optimizer.betas == (0.9, 0.95)
    assert registry.get("kimi_k2_2layer_train_bf16").train.master_weights is True
    names = [name for name, _ in train_state_names(case.model)]
    assert len(names) == 794  # the model level's canonical gradients: one state name per parameter
    flip = registry.get("kimi_k2_2layer_train_control_megatron").train.flip
    assert flip.side == "b" and flip.tensor in names


def test_outputs_follow_a_step_in_its_own_order_and_masters_only_in_bf16(tmp_path):
    registry = registry_from(tmp_path, tiny_train_case("t32"), tiny_train_case("t16", dtype="bfloat16"))
    names = [s.name for s in registry.get("t32").output_specs()]
    step1 = [n for n in names if n.startswith("step1.")]
    kinds = [n.split(".")[1] for n in step1]
    order = ["lr", "loss", "grad", "grad_norm", "clip_coeff", "exp_avg", "exp_avg_sq", "param", "expert_bias"]
    assert [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k] == order
    assert names.index("step1.param.lm_head.weight") < names.index("step2.lr")
    bf16 = {s.name: s for s in registry.get("t16").output_specs()}
    assert bf16["step1.master.lm_head.weight"].dtype == "float32"
    assert bf16["step1.loss"].shape == (2,) and bf16["step2.lr"].dtype == "float64"
    assert not any(".master." in n for n in names)


def test_the_norm_and_the_clip_factor_are_in_the_gradients_dtype_and_absent_without_clipping(tmp_path):
    """Issue 29, finding 6: they were float64 on every stack, so Megatron's doubles never equalled the float32 values
    torch and Paddle apply; without clipping the harness computed torch's and Paddle's norm itself and wrote it as
    theirs. Now each is at the precision the gradients are scaled in, and without clipping no clip factor is
    written and the norm is optional (Megatron computes one anyway; torch and Paddle none)."""
    from harness.case.specs import resolve_dtype

    registry = registry_from(tmp_path, tiny_train_case("t32"), tiny_train_case("t16", dtype="bfloat16"),
                             tiny_train_case("t64", dtype="float64"),
                             tiny_train_case("unclipped", train={**TINY_TRAIN, "clip_grad": 0.0}))
    for name, wide in (("t32", "float32"), ("t16", "float32"), ("t64", "float64")):
        case = registry.get(name)
        specs = {s.name: s for s in case.output_specs()}
        for scalar in ("grad_norm", "clip_coeff"):
            assert resolve_dtype(specs[f"step1.{scalar}"].dtype, case.dtype) == wide, (name, scalar)
            assert not specs[f"step1.{scalar}"].optional
    unclipped = {s.name: s for s in registry.get("unclipped").output_specs()}
    assert "step1.clip_coeff" not in unclipped and unclipped["step1.grad_norm"].optional


def test_each_micro_batch_has_its_own_ids_and_labels_the_next_token(tmp_path):
    case = registry_from(tmp_path, tiny_train_case()).get("tiny_train")
    tensors = generate(case)
    assert "input_ids" not in tensors
    for step in (1, 2):
        for mb in (0, 1):
            ids, labels = tensors[f"step{step}.mb{mb}.input_ids"], tensors[f"step{step}.mb{mb}.labels"]
            assert np.array_equal(labels[:-1], ids[1:]) and labels[-1] == -100
    assert not np.array_equal(tensors["step1.mb0.input_ids"], tensors["step1.mb1.input_ids"])


@pytest.mark.parametrize("train, field", [
    ({"steps": 0}, "train.steps"),
    ({"micro_batches": 0}, "train.micro_batches"),
    ({"lr": -1.0}, "train.lr"),
    ({"min_lr": 1.0}, "train.min_lr"),
    ({"betas": [0.9]}, "train.betas"),
    ({"betas": [0.9, 1.0]}, "train.betas"),
    ({"eps": 0.0}, "train.eps"),
    ({"weight_decay_params": "norms"}, "train.weight_decay_params"),
    ({"decay_style": "linear"}, "train.decay_style"),
    ({"warmup_steps": 2, "decay_steps": 2}, "train.warmup_steps"),
    ({"torch_adamw": "apex"}, "train.torch_adamw"),
    ({"master_weights": True}, "train.master_weights"),
    ({"steps_kept": [0]}, "train.steps_kept"),
    ({"steps_kept": "some"}, "train.steps_kept"),
    ({"momentum": 0.9}, "train.momentum"),
    ({"lr": "high"}, "train.lr"),
    ({"flip": {"side": "c", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.weight", "index": [0, 0],
               "bit": 3}}, "train.flip.side"),
    ({"flip": {"side": "b", "after_step": 2, "state": "exp_avg", "tensor": "lm_head.weight", "index": [0, 0],
               "bit": 3}}, "train.flip.after_step"),
    ({"flip": {"side": "b", "after_step": 1, "state": "grad", "tensor": "lm_head.weight", "index": [0, 0],
               "bit": 3}}, "train.flip.state"),
    ({"flip": {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.bias", "index": [0, 0],
               "bit": 3}}, "train.flip.tensor"),
    ({"flip": {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.weight", "index": [128, 0],
               "bit": 3}}, "train.flip.index"),
    ({"flip": {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.weight", "index": [0, 0],
               "bit": 31}}, "train.flip.bit"),
    ({"dp": 2, "flip": {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.weight",
                        "index": [0, 0], "bit": 3, "rank": 2}}, "train.flip.rank"),
    ({"flip": {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": "lm_head.weight", "index": [0, 0],
               "bit": 3, "rank": -1}}, "train.flip.rank"),
])
def test_bad_train_fields_name_file_case_field_and_value(tmp_path, train, field):
    (tmp_path / "bad.toml").write_text(tiny_train_case("bad", train={**TINY_TRAIN, **train}))
    with pytest.raises(CaseError, match=f"bad.toml: case 'bad': field '{field}'"):
        Registry.load(tmp_path)


FLIP_SGD = {"side": "b", "after_step": 1, "state": "momentum_buffer", "tensor": "lm_head.weight", "index": [0, 0],
            "bit": 3}


@pytest.mark.parametrize("train, field, why", [
    ({"optimizer": "adam"}, "train.optimizer", "must be one of adamw, sgd"),
    ({"betas": [0.9, 0.95]}, "train.betas", "is a setting of AdamW"),
    ({"torch_adamw": "fused"}, "train.torch_adamw", "is a setting of AdamW"),
    ({"momentum": 0.0}, "train.momentum", "must be in"),
    ({"momentum": 1.0}, "train.momentum", "must be in"),
    ({"distributed_optimizer": True}, "train.distributed_optimizer", "Megatron.s DistributedOptimizer takes Adam only"),
    ({"flip": {**FLIP_SGD, "state": "exp_avg"}}, "train.flip.state", "must be one of momentum_buffer, param"),
])
def test_bad_sgd_fields_name_file_case_field_and_value(tmp_path, train, field, why):
    (tmp_path / "bad.toml").write_text(tiny_train_case("bad", train={**TINY_SGD, **train}))
    with pytest.raises(CaseError, match=f"bad.toml: case 'bad': field '{field}': {why}"):
        Registry.load(tmp_path)


def test_an_sgd_case_writes_its_buffer_and_names_its_optimizer_in_the_request(tmp_path):
    """The wire format: AdamW's dict as before (no `optimizer` key), SGD's with `optimizer` and its own field in
    place of AdamW's; TrainSettings reads either back as it was parsed."""
    from harness.case.train_settings import TrainSettings

    registry = registry_from(tmp_path, tiny_train_case("adamw"),
                             tiny_train_case("sgd", train={**TINY_SGD, "flip": FLIP_SGD}))
    adamw, sgd = registry.get("adamw"), registry.get("sgd")
    assert "optimizer" not in adamw.config["train"] and list(adamw.config["train"])[4:6] == ["betas", "eps"]
    wire = sgd.config["train"]
    assert (wire["optimizer"], wire["momentum"]) == ("sgd", 0.9)
    assert not {"betas", "eps", "torch_adamw"} & set(wire)
    for case in (adamw, sgd):
        assert TrainSettings.from_dict(case.config["train"]) == case.train
        assert case.train.to_dict() == case.config["train"]
    assert sgd.train.flip.state == "momentum_buffer" and sgd.train.record.state == ("momentum_buffer",)
    quantities = {s.name.split(".")[1] for s in sgd.output_specs()}
    assert "momentum_buffer" in quantities and not quantities & {"exp_avg", "exp_avg_sq"}
    with pytest.raises(ValueError, match="unknown betas"):
        TrainSettings.from_dict({**wire, "betas": [0.9, 0.95]})


def test_an_optimizer_state_is_named_by_its_record_only(tmp_path):
    """Issue 30: the state names live in one place. No string literal in the harness outside harness/optimizers/
    names an optimizer's state or Paddle's accumulator of it: the quantities tuples derive from the record. The
    check sees one planted in a file of its own (its control)."""
    from pathlib import Path

    from harness.optimizers import OPTIMIZERS

    names = {q for o in OPTIMIZERS.values() for q in (*o.state, *o.paddle_accumulators.values())}
    package = Path(__file__).resolve().parents[1] / "harness"
    paths = [p for p in package.rglob("*.py") if "optimizers" not in p.relative_to(package).parts]
    assert not _literals(paths, names)
    (tmp_path / "planted.py").write_text('"""exp_avg in a docstring is prose."""\nQUANTITIES = ("grad", "exp_avg")\n')
    assert _literals([tmp_path / "planted.py"], names) == [f"{tmp_path / 'planted.py'}:2 'exp_avg'"]


def _literals(paths, names) -> list[str]:
    import ast

    return [f"{path}:{node.lineno} {node.value!r}" for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and node.value in names]


def test_train_is_refused_on_other_ops_and_required_fields_come_from_defaults(tmp_path):
    (tmp_path / "bad.toml").write_text(tiny_train_case("bad", op="causal_lm"))
    with pytest.raises(CaseError, match="field 'train': is only for training ops"):
        Registry.load(tmp_path)
    (tmp_path / "ok").mkdir()
    case = registry_from(tmp_path / "ok", tiny_train_case("plain", train=None)).get("plain")
    assert case.train.steps == 3 and case.train.lr == 1e-3


def test_steps_kept_on_the_command_line():
    assert parse_steps_kept("all", 4) == [1, 2, 3, 4] and parse_steps_kept("last", 4) == [4]
    assert parse_steps_kept("3,1,3", 4) == [1, 3]
    with pytest.raises(ValueError, match="--steps-kept 5: step 5 is outside 1..4"):
        parse_steps_kept("5", 4)
    assert parse_steps_kept("none", 4) == []
    with pytest.raises(ValueError, match="expected all, last, none or step numbers"):
        parse_steps_kept("first", 4)


def test_step_files_are_validated_against_the_case(tmp_path):
    """The harness's check of a training side's outputs (a test double writes the files: numpy, no framework)."""
    from safetensors.numpy import load_file, save_file

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps_kept": [2]})).get("tiny_train")
    train, m = case.train, case.config["model"]
    from harness.case.ops import train_step_outputs

    def write(kept_all=False, drop=None, change=None):
        writer = steps.StepWriter(tmp_path / "side", train.steps_kept if not kept_all else [1, 2],
                                  lambda t, path, meta: save_file(t, path, meta),
                                  lambda a: np.ascontiguousarray(a).view(np.uint8))
        for step in (1, 2):
            tensors = {s.name.split(".", 1)[1]: np.zeros(s.shape, dtype=np.float64 if s.dtype == "float64"
                                                           else np.float32)
                       for s in train_step_outputs(m, train, step) if s.name != drop}
            if change and f"step{step}.{change[0]}" in {s.name for s in train_step_outputs(m, train, step)}:
                tensors[change[0]] = change[1]
            scalars = {k: v for k, v in tensors.items() if "." not in k}
            writer.write(step, scalars, {k: v for k, v in tensors.items() if "." in k})

    write()
    assert steps.validate(tmp_path / "side", case) == ""
    header = steps.read_header(steps.step_file(tmp_path / "side", 1))
    assert not header.kept and "step1.lr" in header.layouts and "step1.param.lm_head.weight" in header.digests
    assert "step1.param.lm_head.weight" not in header.layouts
    assert header.digest_layouts["step1.param.lm_head.weight"] == ["float32", [128, 64]]
    write(kept_all=True)
    assert "kept is True, the request keeps steps [2]" in steps.validate(tmp_path / "side", case)
    write(drop="step2.exp_avg.lm_head.weight")
    assert "lacks tensor 'step2.exp_avg.lm_head.weight'" in steps.validate(tmp_path / "side", case)
    # a digest-only step is held to the dtypes and shapes of the case as a kept one (issue 29, finding 7)
    write(change=("param.lm_head.weight", np.zeros((64, 128), np.float32)))
    assert steps.validate(tmp_path / "side", case).endswith(
        "step00001.safetensors: tensor 'step1.param.lm_head.weight' is float32[64, 128], expected float32[128, 64]")
    write(change=("exp_avg.lm_head.weight", np.zeros((128, 64), np.float64)))
    assert "tensor 'step1.exp_avg.lm_head.weight' is float64[128, 64], expected float32" in \
        steps.validate(tmp_path / "side", case)
    write()  # a step file of a harness that hashed with BLAKE2b (bare hex digests) is refused, not compared
    path = steps.step_file(tmp_path / "side", 1)
    digests = steps.read_header(path).digests
    save_file(load_file(str(path)), str(path), {"kept": "false", "digests": json.dumps(
        {name: value.split(":", 1)[1] for name, value in digests.items()})})
    assert "is not xxh3_128" in steps.validate(tmp_path / "side", case)
    save_file(load_file(str(path)), str(path), {"kept": "false", "digests": json.dumps(digests)})  # no layouts
    assert "has no layout (dtype, shape) of the digested 'step1.grad." in steps.validate(tmp_path / "side", case)


def test_two_digests_are_equal_only_for_the_same_dtype_and_shape(tmp_path):
    """Equal bytes in another shape or dtype have the same digest: the comparator does not call them equal."""
    from safetensors.numpy import save_file

    from harness.case.specs import TensorSpec
    from harness.compare.train_steps import _compare_step
    from harness.run.orchestrate import SideResult

    def side(name, tensor):
        writer = steps.StepWriter(tmp_path / name, [], lambda t, path, meta: save_file(t, path, meta),
                                  lambda a: np.ascontiguousarray(a).view(np.uint8))
        writer.write(1, {}, {"param.w": tensor})
        return SideResult(name, "double", "ok", tmp_path / name, "python")

    zeros = np.zeros((2, 3), np.float32)
    spec = [TensorSpec("step1.param.w", (2, 3), "output", "float32")]
    same, other_shape, other_dtype = side("a", zeros), side("b", zeros.reshape(3, 2)), side("c", zeros.view(np.int32))
    assert _compare_step(1, spec, [same, same])[0].status == "EQUAL"
    assert _compare_step(1, spec, [same, other_shape])[0].status == "SHAPE_MISMATCH"
    assert _compare_step(1, spec, [same, other_dtype])[0].status == "DTYPE_MISMATCH"


def test_digests_hashed_in_batches_are_each_tensors_own_in_order(tmp_path, monkeypatch):
    """StepWriter hashes small tensors in batches (steps._batches): every digest is still its own tensor's, in order."""
    from safetensors.numpy import save_file

    monkeypatch.setattr(steps, "DIGEST_BATCH_BYTES", 64)
    rng = np.random.default_rng(0)
    states = {f"param.w{i}": rng.standard_normal(size).astype(np.float32) for i, size in
              enumerate([1, 3, 40, 2, 7, 16, 5])}  # bytes: 4 + 12 + 160, then 8 + 28 + 64, then 20
    assert [len(batch) for batch in steps._batches(states.values())] == [3, 3, 1]
    writer = steps.StepWriter(tmp_path, [], lambda t, path, meta: save_file(t, path, meta),
                              lambda a: np.ascontiguousarray(a).view(np.uint8))
    writer.write(1, {"lr": np.zeros((), np.float64)}, states)
    digests = steps.read_header(steps.step_file(tmp_path, 1)).digests
    assert digests == {f"step1.{name}": steps.digest(value.view(np.uint8)) for name, value in states.items()}
    assert len(set(digests.values())) == len(states)


def test_refeed_attribution_names_what_made_each_difference():
    """harness.compare.train_refeed.attribute on hand-made comparisons (a test double of three runs' verdicts)."""
    from harness.compare.tensors import DIFF, EQUAL, TensorComparison
    from harness.compare.train_refeed import attribute

    names = ["step1.lr", "step1.loss", "step1.grad.w", "step1.grad_norm", "step1.exp_avg.w", "step1.param.w",
             "step2.exp_avg.w", "step2.expert_bias.b"]

    def run(differing):
        return [TensorComparison(n, DIFF if n in differing else EQUAL) for n in names]

    plain = run({"step1.lr", "step1.loss", "step1.grad.w", "step1.grad_norm", "step1.exp_avg.w", "step1.param.w",
                 "step2.exp_avg.w", "step2.expert_bias.b"})
    state = run({"step1.loss", "step1.grad.w", "step1.grad_norm", "step1.exp_avg.w", "step1.param.w",
                 "step2.expert_bias.b"})
    update = run({"step1.grad_norm", "step1.param.w"})
    step1, step2 = attribute(plain, state, update)
    assert step1["attribution"] == {
        "lr": "1 made by the schedule", "loss": "1 made by the step's forward/backward",
        "grad": "1 made by the step's forward/backward", "grad_norm": "1 made by the optimizer on side a's gradients",
        "exp_avg": "1 made by the step's gradients", "param": "1 made by the optimizer on side a's gradients"}
    assert step2["attribution"] == {"exp_avg": "1 carried in", "expert_bias": "1 made by the step"}
    assert step1["made"]["grad"] == ["step1.grad.w"] and "exp_avg" not in step2["made"]


def test_knob_matrix_counts_differences_per_quantity_and_says_what_a_knob_removed():
    """harness.commands.train_matrix and its report on hand-made cells (test doubles of two runs' summaries)."""
    from harness.commands.train_matrix import differing_per_quantity, knobs_for
    from harness.optimizers import OPTIMIZERS
    from harness.report.train_matrix_report import markdown

    step = {"scalars": {"lr": {"equal": True}, "grad_norm": {"equal": False}},
            "quantities": {"param": {"equal": 30, "total": 42}, "expert_bias": {"equal": 0, "total": 1}}}
    assert differing_per_quantity({"steps": [step, step]}) == {"lr": 0, "grad_norm": 2, "param": 24,
                                                                "expert_bias": 2}
    removed = {"scalars": step["scalars"], "quantities": {**step["quantities"],
                                                          "expert_bias": {"equal": 1, "total": 1}}}
    cells = [{"setting": {}, "verdict": "DIFF", "first_divergence": None, "report": "r0", "sides": "a vs b",
              "differing": differing_per_quantity({"steps": [step, step]})},
             {"setting": {"expert_bias_update": "off"}, "verdict": "DIFF", "first_divergence": None,
              "report": "r1", "sides": "a vs b", "differing": differing_per_quantity({"steps": [removed, removed]})}]
    rows = [line for line in markdown("case", cells).splitlines() if line.startswith("| ")]
    assert any("expert_bias_update = off" in row and "| 0 (-2) |" in row for row in rows), rows
    assert {"expert_bias_update": "off"} in knobs_for(("megatron_model", "hf_model"))
    assert {"torch_adamw": "fused"} not in knobs_for(("megatron_model", "paddle_model"))
    sgd = knobs_for(("megatron_model", "hf_model"), OPTIMIZERS["sgd"])  # no torch flag, no distributed optimizer
    assert not any("torch_adamw" in k or "distributed_optimizer" in k for k in sgd) and {"clip_grad": 0.0} in sgd


def test_truth_distance_counts_differing_bits_and_the_largest_difference():
    import ml_dtypes

    from harness.compare.tensors import compare_tensor
    from harness.compare.train_steps import distance

    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float64):
        a = rng.standard_normal((50, 7)).astype(dtype)
        b = a.copy()
        b[3, 4], b[10, 1] = b[3, 4] * 2, -b[10, 1]
        full = compare_tensor("x", a, b)
        assert distance(a, b) == (full.mismatches, full.max_abs_error) == (2, full.max_abs_error)
        assert distance(a[0, 0], a[0, 0].copy()) == (0, 0.0)


def test_steps_kept_is_refused_on_other_cases_and_outside_the_steps(tmp_path):
    from harness import CompareOptions, compare_case
    from tests.support.cases import tiny_case

    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "t.toml").write_text(tiny_case("lin") + tiny_train_case("tr"))
    options = CompareOptions(cases_dir=cases, reports_dir=tmp_path / "reports", checkpoints_dir=tmp_path / "ck")
    result, _ = compare_case("lin", replace(options, steps_kept="last"))
    assert result.verdict == "ERROR" and "--steps-kept is for training cases" in result.message
    result, _ = compare_case("tr", replace(options, steps_kept="3"))
    assert result.verdict == "ERROR" and "--steps-kept 3: step 3 is outside 1..2" in result.message


def test_the_command_line_passes_steps_kept(tmp_path, capsys):
    from harness.cli import main

    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "t.toml").write_text(tiny_train_case("tr"))
    code = main(["--cases", str(cases), "compare", "tr", "--steps-kept", "9", "--reports", str(tmp_path / "r"),
                 "--checkpoints", str(tmp_path / "ck")])
    assert code == 2 and "--steps-kept 9: step 9 is outside 1..2" in capsys.readouterr().out


def test_memory_is_sized_for_one_step_not_all_of_them(monkeypatch):
    """Each side writes, and the comparator reads, one step at a time: 100 steps need what 3 steps need (the GPU
    _full twin was refused at 229.5 GiB, all three steps' state summed, on a machine with 125 GiB)."""
    from harness import resources
    from harness.case import checkpoints

    needs = []
    monkeypatch.setattr(resources, "check_memory", lambda need, what: needs.append(need))
    registry = Registry.load()
    for name in ("kimi_k2_2layer_train", "kimi_k2_2layer_train_100"):
        checkpoints.check_memory(replace(registry.get(name), runners=("megatron_model", "hf_model")))
    three, hundred = needs
    assert three < hundred < 1.01 * three  # the extra steps add only their ids and labels (all steps: 33 times)


def _write_run(folder, case, change=None):
    """A test double of a training side's step files (numpy): zeros, with `change` {step: [tensor]} set to one."""
    from safetensors.numpy import save_file

    from harness.case.ops import train_step_outputs
    from harness.case.specs import resolve_dtype

    train, m = case.train, case.config["model"]
    writer = steps.StepWriter(folder, train.steps_kept, lambda t, path, meta: save_file(t, path, meta),
                              lambda a: np.ascontiguousarray(a).view(np.uint8))
    for step in range(1, train.steps + 1):
        tensors = {}
        for spec in train_step_outputs(m, train, step):
            name = spec.name.split(".", 1)[1]
            value = np.zeros(spec.shape, dtype=resolve_dtype(spec.dtype, case.dtype))
            tensors[name] = value + 1 if name in (change or {}).get(step, ()) else value
        writer.write(step, {k: v for k, v in tensors.items() if "." not in k},
                     {k: v for k, v in tensors.items() if "." in k})


def test_a_refed_step_that_does_not_give_side_bs_own_bits_is_named(tmp_path):
    """The re-feed's own check (issue 29, finding 5; harness.compare.train_refeed.reproduces, on test doubles of step
    files): where side b's plain step started from side a's inputs, the re-fed step must give side b's plain bits;
    a step it differs at is named, and a step whose inputs differed in the plain run is not checked."""
    from harness.compare.train_refeed import reproduces
    from harness.compare.train_steps import compare_steps
    from harness.run.orchestrate import SideResult

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 3, "decay_steps": 3})) \
        .get("tiny_train")
    sides = {}
    for label, change in (("a", {2: ["param.lm_head.weight"]}), ("b", None), ("refed", {3: ["loss"]})):
        _write_run(tmp_path / label, case, change)
        sides[label] = SideResult(label, "double", "ok", tmp_path / label, "python")
    plain, _ = compare_steps(case, [sides["a"], sides["b"]])
    check = reproduces(case, plain, sides["b"], sides["refed"], "state")
    assert check == {"checked": [1, 2], "not_reproduced": []}  # step 3 starts from step 2's differing parameter
    _write_run(tmp_path / "refed", case, {2: ["exp_avg.lm_head.weight"]})
    check = reproduces(case, plain, sides["b"], sides["refed"], "state")
    assert check["not_reproduced"] == [{"step": 2, "count": 1, "tensors": ["step2.exp_avg.lm_head.weight"]}]


def test_a_load_that_would_change_a_dtype_or_a_shape_is_refused():
    """Issue 29, finding 5: re-feed loads cast dtypes silently (copy_, set_value). A load keeps every bit or is
    refused, naming the tensor; an exact widening that the stack itself made (Megatron's float32 routing bias, written
    upcast in a float64 case) loads."""
    torch = pytest.importorskip("torch")
    from harness.runners.torch.train_state import keeps_bits

    keeps_bits(torch.tensor([0.5, -2.0], dtype=torch.float64), torch.float32, "bias")  # exact: loads
    with pytest.raises(ValueError, match="loading bias would round its torch.float64 value to torch.float32"):
        keeps_bits(torch.tensor([0.1], dtype=torch.float64), torch.float32, "bias")
    with pytest.raises(ValueError, match="would round its torch.float32 value to torch.bfloat16"):
        keeps_bits(torch.tensor([1.0 + 2 ** -12]), torch.bfloat16, "param.w")


def test_paddle_refuses_a_load_of_another_dtype_or_shape():
    paddle = pytest.importorskip("paddle")
    from harness.runners.paddle.train import _fits

    target = paddle.zeros([2, 3], dtype="float32")
    _fits(np.zeros((2, 3), np.float32), target, "param.w")
    with pytest.raises(ValueError, match=r"param.w is float64\[2, 3\], Paddle's tensor float32\[2, 3\]"):
        _fits(np.zeros((2, 3), np.float64), target, "param.w")
    with pytest.raises(ValueError, match=r"float32\[3, 2\]"):
        _fits(np.zeros((3, 2), np.float32), target, "param.w")


def test_a_kept_step_gives_its_zero_blocks_back_to_the_disk_its_bytes_unchanged(tmp_path):
    """Issue 47: a MoE step file is about a third zeros (the experts no token reached: 0.50 of 1.35 GB a side of
    minimax_m2_2layer_train at 16 tokens); StepWriter punches those blocks out (harness.run.sparse_files), so a night's
    peak shrinks while every reader reads the same bytes. A digest-only step is left as written."""
    from safetensors.numpy import load_file, save_file

    rng = np.random.default_rng(0)
    states = {"grad.expert0": np.zeros((512, 1024), np.float32), "param.expert0": rng.standard_normal(
        (512, 1024)).astype(np.float32), "exp_avg.expert1": np.zeros((512, 1024), np.float32)}
    writer = steps.StepWriter(tmp_path, [1], lambda t, path, meta: save_file(t, path, meta),
                              lambda a: np.ascontiguousarray(a).view(np.uint8))
    writer.write(1, {"lr": np.ones((), np.float64)}, states)
    path = steps.step_file(tmp_path, 1)
    assert {name: value.tobytes() for name, value in load_file(path).items()} == {
        "step1.lr": np.ones((), np.float64).tobytes(), **{f"step1.{k}": v.tobytes() for k, v in states.items()}}
    on_disk, size = path.stat().st_blocks * 512, path.stat().st_size
    assert size > 6 << 20 and on_disk < size * 0.4  # 4 MiB of zeros of 6 MiB given back; 2 MiB of numbers kept


def test_a_night_judges_each_step_as_it_is_written_and_gives_its_tensors_back(tmp_path):
    """Issue 47 (harness.compare.train_follow, on test doubles of step files): a night's training case held every step
    of its runs whole until they ended. Followed, each step is judged once both runs wrote it, the records those of the
    comparison after the runs, and a paced run never holds more than one whole step besides the first divergence's;
    every step but that one ends given back, its digests and scalars kept, and the files still pass validation."""
    import threading
    import time

    from harness.compare import train_follow
    from harness.compare.train_steps import compare_steps
    from harness.run.orchestrate import SideResult

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 5, "decay_steps": 5})) \
        .get("tiny_train")
    changes = {"a": None, "b": {3: ["param.lm_head.weight"]}}
    plain = {label: SideResult(label, "double", "ok", tmp_path / "plain" / label, "") for label in changes}
    for label, change in changes.items():
        _write_run(plain[label].folder, case, change)
    expected = compare_steps(case, list(plain.values()))

    runs = {label: SideResult(label, "double", "ok", tmp_path / "night" / label, "") for label in changes}
    for run in runs.values():
        run.folder.mkdir(parents=True)
        (run.folder / "request.json").write_text(json.dumps({"config": {steps.PACE: True}}))
    follower = train_follow.follow(case, list(runs.values()), None, None)
    most, writing = {label: 0 for label in runs}, [
        threading.Thread(target=_write_run, args=(runs[label].folder, case, change), daemon=True)
        for label, change in changes.items()]
    for thread in writing:
        thread.start()
    while any(thread.is_alive() for thread in writing):
        for label, run in runs.items():
            held = [name for name in whole_steps(run.folder) if name != "step00003.safetensors"]  # the divergence's
            most[label] = max(most[label], len(held))
        time.sleep(0.01)
    for run in runs.values():
        steps.mark(run.folder, steps.ENDED)
    follower.finish()
    follower.judged_all()
    rows, summary, check = follower.judge.results(None)
    assert [row.to_dict() for row in rows] == [row.to_dict() for row in expected[0]]
    assert summary == expected[1] and summary["first_divergence"]["step"] == 3 and check is None
    assert max(most.values()) <= 1
    for run in runs.values():
        assert whole_steps(run.folder) == ["step00003.safetensors"]
        header = steps.read_header(steps.step_file(run.folder, 1))
        assert header.given_back and not header.kept and "step1.lr" in header.layouts
        assert header.digests["step1.param.lm_head.weight"] == next(
            row.digests[0] for row in expected[0] if row.name == "step1.param.lm_head.weight")
        assert steps.validate(run.folder, case) == ""


def test_a_followed_case_whose_side_ends_early_gives_back_the_other_runs_steps_as_they_land(tmp_path):
    """Issue 47: minimax_m2_2layer_train_paddle, whose Paddle side is UNSUPPORTED here, ran side a and the truth to
    their end, every step whole, though nothing compares them. Followed, a side that ends before its first step
    releases the others (none waits for a step that will never be judged) and their steps are given back as they
    land; no step is judged, and the comparison that reads the records refuses (test doubles of step files)."""
    from harness.compare import train_follow
    from harness.run.orchestrate import SideResult

    case = registry_from(tmp_path, tiny_train_case(train={**TINY_TRAIN, "steps": 3, "decay_steps": 3})) \
        .get("tiny_train")
    runs = [SideResult(label, "double", "ok", tmp_path / label, "") for label in "ab"]
    for run in runs:
        run.folder.mkdir()
        (run.folder / "request.json").write_text(json.dumps({"config": {steps.PACE: True}}))
    steps.mark(runs[1].folder, steps.ENDED)  # side b: UNSUPPORTED, no step written
    follower = train_follow.follow(case, runs, None, None)
    _write_run(runs[0].folder, case)  # paced: it would wait for step 1 to be judged, were it not released
    steps.mark(runs[0].folder, steps.ENDED)
    follower.finish()
    assert follower.abandoned and follower.judged == 0
    assert whole_steps(runs[0].folder) == [] and steps.validate(runs[0].folder, case) == ""
    with pytest.raises(RuntimeError, match="judged 0 of 3 steps"):
        follower.judged_all()


def test_a_step_file_appears_whole_or_not_at_all(tmp_path):
    """A night follows a run's step files as they are written (issue 47), so a step file is written under another
    name and renamed once whole: a save that fails (a full disk) leaves neither the step file nor a part of it."""
    from safetensors.numpy import save_file

    def full_disk(tensors, path, metadata):
        save_file(tensors, path, metadata)
        raise OSError(28, "No space left on device")

    writer = steps.StepWriter(tmp_path, [1], full_disk, lambda a: np.ascontiguousarray(a).view(np.uint8))
    with pytest.raises(OSError, match="No space left"):
        writer.write(1, {"lr": np.array(1e-3, np.float32)}, {"param.w": np.ones((4, 4), np.float32)})
    assert not list((tmp_path / steps.STEPS_DIR).iterdir())
    writer.save = lambda tensors, path, metadata: save_file(tensors, path, metadata)
    writer.write(1, {"lr": np.array(1e-3, np.float32)}, {"param.w": np.ones((4, 4), np.float32)})
    assert [path.name for path in (tmp_path / steps.STEPS_DIR).iterdir()] == ["step00001.safetensors"]
