"""The training level end to end on the CPU with the real stacks: tiny 2-layer DeepSeek-V3 (8 experts top-2, widths
of a few dozen, 8 tokens), 2 steps of 2 micro-batches (tests/support/train.py), each side in its own training code.

- Megatron-Core against HF gives a verdict per step, the first divergence in time, and the float64 truth per step.
- The negative control: one bit of one Adam moment flipped on side b after step 1 is found at step 2 in exactly that
  parameter's exp_avg and parameter, and nowhere else at step 2; step 1 is bitwise equal.
- A stack against itself is bitwise equal at every step (the runs are deterministic across processes); with only
  some steps kept the others are compared by digest and give the same per-tensor verdicts.
- Megatron-Core against PaddleFormers gives per-step verdicts; Paddle cannot train in bf16 on a CPU (UNSUPPORTED,
  the kernel named).
- SGD with momentum (harness/optimizers/sgd.py) on the three stacks: on side a's gradients Megatron's SGD is
  torch.optim.SGD bit for bit, Paddle's Momentum is not (its own rounding); one flipped bit of a momentum buffer is
  found where it must be on Megatron and on Paddle; each stack re-fed from its own SGD state reproduces itself; the
  float64 check judges the buffer.
- GLM-4.5 MoE (glm4_moe), whose q, k and v are one interleaved tensor on Megatron and Paddle: the registry's training
  cases give their per-step verdicts on this CPU, its control is found in its part of the fused tensor (Megatron and
  Paddle), the float64 check passes for every pair it can run, and each stack re-fed from its own state reproduces
  itself.
"""

import json

import pytest

from conftest import E2E_TOKENS
from harness import CompareOptions, compare_case
from harness.case.registry import Registry
from tests.support.cases import write_cases
from tests.support.doubles import ten_x_lr_at_step
from tests.support.e2e import assert_repeats_the_record, committed_record, on_amd_avx512_bf16
from tests.support.train import TINY_GLM, TINY_MODEL, TINY_SGD, TINY_TRAIN, run_train_case, tiny_train_case

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("runner_workers")]

TENSOR = "model.layers.0.self_attn.q_a_proj.weight"
FLIP = {"side": "b", "after_step": 1, "state": "exp_avg", "tensor": TENSOR, "index": [5, 7], "bit": 20}
FLIP_SGD = {**FLIP, "state": "momentum_buffer"}
ALIGNED = {"expert_bias_update": "off", "weight_decay_params": "not_1d"}  # the stacks' choices made the same
RUNNERS = ("megatron_model", "hf_model", "paddle_model")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return write_cases(tmp_path_factory.mktemp("train-cases"), *[
        tiny_train_case("t_megatron_hf"),
        tiny_train_case("t_megatron_paddle", runners=["megatron_model", "paddle_model"]),
        tiny_train_case("t_control_megatron", runners=["megatron_model", "megatron_model"],
                        train={**TINY_TRAIN, "flip": FLIP}),
        tiny_train_case("t_hf_kept", runners=["hf_model", "hf_model"],
                        train={**TINY_TRAIN, "flip": FLIP, "steps_kept": [1]}),
        tiny_train_case("t_paddle_bf16", runners=["paddle_model", "paddle_model"], dtype="bfloat16"),
        tiny_train_case("t_megatron_hf_aligned", train={**TINY_TRAIN, **ALIGNED, "clip_grad": 0.0}),
        tiny_train_case("t_float64", dtype="float64", train={**TINY_TRAIN, **ALIGNED}),
        tiny_train_case("t_float64_night", dtype="float64", train={**TINY_TRAIN, **ALIGNED, "steps": 3,
                                                                   "decay_steps": 3}),
        tiny_train_case("t_float64_dense", dtype="float64", train={**TINY_TRAIN, **ALIGNED},
                        config={"model": {**TINY_MODEL, "first_k_dense_replace": 2}}),
        *[tiny_train_case(f"t_self_{runner}", runners=[runner, runner]) for runner in RUNNERS],
        tiny_train_case("t_sgd_megatron_hf_aligned", train={**TINY_SGD, **ALIGNED, "clip_grad": 0.0}),
        tiny_train_case("t_sgd_megatron_paddle_aligned", runners=["megatron_model", "paddle_model"],
                        train={**TINY_SGD, **ALIGNED, "clip_grad": 0.0}),
        *[tiny_train_case(f"t_sgd_control_{runner}", runners=[runner, runner], train={**TINY_SGD, "flip": FLIP_SGD})
          for runner in ("megatron_model", "paddle_model")],
        *[tiny_train_case(f"t_sgd_self_{runner}", runners=[runner, runner], train=TINY_SGD) for runner in RUNNERS],
        tiny_train_case("t_sgd_float64", dtype="float64", train={**TINY_SGD, **ALIGNED}),
        tiny_train_case("t_night_follow", train={**TINY_TRAIN, "steps": 4, "decay_steps": 4}),
        tiny_train_case("t_float64_planted", dtype="float64", runners=["hf_model", "hf_model"],
                        train={**TINY_TRAIN, **ALIGNED},
                        perturb={"side": "b", "tensor": "model.layers.0.self_attn.kv_b_proj.weight", "index": [5, 3],
                                 "bit": 50}),
    ])



def test_megatron_against_hf_gives_a_verdict_per_step_and_the_truth_per_step(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_megatron_hf", cases, tmp_path, checkpoints_dir)
    # two implementations of the model (MLA, the router, the loss) part at step 1's loss on any CPU
    assert result.verdict == "DIFF" and result.exit_code == 1, (result.message, tails)
    train = report["train"]
    assert [s["step"] for s in train["steps"]] == [1, 2] and train["parameters"] == 42
    for step in train["steps"]:
        assert step["verdict"] == "DIFF"
        assert set(step["quantities"]) == {"grad", "exp_avg", "exp_avg_sq", "param", "expert_bias"}
        assert step["scalars"]["lr"]["equal"]  # both schedules give 1e-3, then the cosine floor's exact value
        assert set(step["truth"]) >= {"grad", "param", "loss"}, step["truth"]
    first = train["first_divergence"]
    assert first == {"step": 1, "quantity": "loss", "tensor": "step1.loss"}, first
    assert result.first_divergence == first["tensor"]
    for side in report["sides"][:2]:
        assert set(side["meta"]["state_locations"]) >= {"grad", "exp_avg", "param"}
    adapters = {a["name"] for a in report["sides"][0]["meta"]["adapters"]}
    assert {"cuda_factory_to_cpu", "tensor_type_cuda_names", "clip_scale"} <= adapters
    markdown = (run_dir / "report.md").read_text()
    assert "## Training steps" in markdown and "Closer to the float64 truth" in markdown
    assert (run_dir / "pictures" / "train_steps.png").exists()


def test_negative_control_is_found_at_its_step_in_its_parameter(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_control_megatron", cases, tmp_path, checkpoints_dir,
                                                    oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    step1, step2 = report["train"]["steps"]
    assert step1["verdict"] == "BITWISE_PASS"
    assert report["train"]["first_divergence"] == {"step": 2, "quantity": "exp_avg",
                                                   "tensor": f"step2.exp_avg.{TENSOR}"}
    differing = {t["name"] for t in report["tensors"] if t["status"] != "EQUAL" and t["name"].startswith("step2.")}
    assert differing == {f"step2.exp_avg.{TENSOR}", f"step2.param.{TENSOR}"}
    exp_avg = next(t for t in report["tensors"] if t["name"] == f"step2.exp_avg.{TENSOR}")
    assert exp_avg["mismatches"] == 1 and exp_avg["first_mismatch"]["index"] == [5, 7]


def test_a_stack_against_itself_keeps_its_bits_and_digests_stand_for_unkept_steps(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_hf_kept", cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    step1, step2 = report["train"]["steps"]
    assert step1["verdict"] == "BITWISE_PASS" and step1["kept"] and not step2["kept"]
    rows = {t["name"]: t for t in report["tensors"]}
    assert rows[f"step2.exp_avg.{TENSOR}"]["status"] == "DIFF"
    assert "by digest" in rows[f"step2.exp_avg.{TENSOR}"]["note"]
    assert rows[f"step2.grad.{TENSOR}"]["status"] == "EQUAL"
    assert {n for n, t in rows.items() if n.startswith("step2.") and t["status"] != "EQUAL"} == {
        f"step2.exp_avg.{TENSOR}", f"step2.param.{TENSOR}"}
    assert not any(".param." in name for name in _keys(run_dir / "a-hf_model" / "steps" / "step00002.safetensors"))


def _keys(path):
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as handle:
        return list(handle.keys())


@pytest.mark.slow  # 25 s on 2 shared cores (the first tier's longest, 2026-12-06)
def test_megatron_against_paddle_gives_a_verdict_per_step(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_megatron_paddle", cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "DIFF" and result.exit_code == 1, (result.message, tails)  # two models, two losses
    assert [s["verdict"] for s in report["train"]["steps"]] == ["DIFF", "DIFF"] and report["train"]["parameters"] == 42
    assert report["train"]["first_divergence"]["tensor"] == "step1.loss"
    paddle = report["sides"][1]["meta"]
    assert "clip_norm_and_factor" in {a["name"] for a in paddle["adapters"]}
    assert "moment1" in paddle["state_locations"]["exp_avg"]


def test_paddle_cannot_train_bf16_on_a_cpu_and_says_which_kernel(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_paddle_bf16", cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "UNSUPPORTED" and "matmul" in result.message and "bfloat16" in result.message


@pytest.mark.parametrize("case, pair", [("t_float64", ("megatron_model", "hf_model")),
                                        ("t_float64_dense", ("paddle_model", "hf_model")),
                                        ("t_float64_dense", ("megatron_model", "paddle_model"))])
def test_float64_check_judges_every_step_from_the_same_state(cases, tmp_path, checkpoints_dir, case, pair):
    """Issue 29, finding 1: the check read step 1 only. Now: the plain run's step 1 and every step's lr, every tensor
    of the later steps re-fed from side a's state, and the optimizer's outputs of every step on side a's gradients."""
    result, run_dir, report, tails = run_train_case(case, cases, tmp_path, checkpoints_dir, oracle=False, runners=pair)
    semantic = report["train"].get("semantic")
    assert semantic, (result.verdict, result.message, tails)
    assert semantic["ok"], f"mapping error: {semantic['first_mismatch']}: {semantic['tensors_beyond'][:3]}"
    assert result.verdict == "WITHIN_TOLERANCE", result.message  # float64 bits differ between stacks: not news
    parts = {part["judged_by"]: part for part in semantic["parts"]}
    names = [t["name"] for t in report["tensors"]]
    assert parts["the plain run"]["checked"] == sum(n.startswith("step1.") or n == "step2.lr" for n in names)
    assert parts["side b re-fed from side a's state"]["checked"] == sum(n.startswith("step2.") for n in names)
    optimizer = {"grad_norm", "clip_coeff", "exp_avg", "exp_avg_sq", "param"}
    assert parts["side b's optimizer on side a's gradients"]["checked"] == sum(n.split(".")[1] in optimizer
                                                                               for n in names)
    assert report["train"]["refeed"]["status"] == "ok"  # the re-feed proved itself where it could
    assert "side b re-fed from side a's state" in result.message


PLANTS = {  # a fault in HF's own training code (side b), planted at process start (tests/support/doubles.py)
    "10x lr at the last step": ten_x_lr_at_step(2),
    "weight decay on the 1-D parameters too": """
        import torch
        original = torch.optim.AdamW.__init__
        def init(self, params, *args, **kwargs):
            params = list(params)
            for group in params:
                if isinstance(group, dict) and group.get("weight_decay") == 0.0:
                    group.pop("weight_decay")
            original(self, params, *args, **kwargs)
        torch.optim.AdamW.__init__ = init
    """,
}


@pytest.mark.slow  # a pair, its float64 truth and re-feed per plant: 51 s each on 2 shared cores (2026-12-06)
@pytest.mark.parametrize("plant", PLANTS)
def test_float64_check_finds_a_planted_optimizer_fault_at_its_step(cases, tmp_path, checkpoints_dir, plant):
    """Issue 29, finding 1: HF's AdamW made to use 10x its lr at step 3 (the lr it reports unchanged) came out
    WITHIN_TOLERANCE, exit 0. The fault planted in hf_model's process (side b, and its re-fed runs: they are its
    stack) is a mapping error at its step, naming a tensor the optimizer made there."""
    from tests.support.doubles import python_with_startup

    python = python_with_startup(tmp_path, "planted", PLANTS[plant])
    result, run_dir, report, tails = run_train_case("t_float64", cases, tmp_path, checkpoints_dir, oracle=False,
                                                    pythons={"hf_model": python}, fresh_process=True)
    assert result.verdict == "ERROR" and result.exit_code == 2, (result.message, tails)
    step = 2 if plant.startswith("10x") else 1
    assert f"mapping error at step {step}, tensor step{step}." in result.message, result.message
    semantic = report["train"]["semantic"]
    assert semantic["first_step"] == step and semantic["first_mismatch"].split(".")[1] in ("param", "exp_avg"), \
        semantic
    assert report["train"]["steps"][step - 1]["scalars"]["lr"]["equal"]  # the lr both report is the same


def test_float64_disagreement_in_a_state_tensor_is_a_mapping_error_naming_it(cases, tmp_path, checkpoints_dir):
    """A planted difference (bit 50 of one weight element on side b) stands in for a mapping error: step 1's loss,
    the first output of the step, is beyond the agreement, and the run is an ERROR naming it, never a DIFF."""
    result, run_dir, report, tails = run_train_case("t_float64_planted", cases, tmp_path, checkpoints_dir, oracle=False)
    assert result.verdict == "ERROR", (result.message, tails)
    assert "mapping error at step 1, tensor step1.loss (the plain run)" in result.message, result.message
    assert report["train"]["semantic"]["first_mismatch"] == "step1.loss"


def test_refeed_in_time_says_the_planted_bit_was_carried_into_step_2(cases, tmp_path, checkpoints_dir):
    result, run_dir, report, tails = run_train_case("t_control_megatron", cases, tmp_path, checkpoints_dir,
                                                    oracle=False, refeed_ops=True)
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    step1, step2 = refeed["steps"]
    assert step1["attribution"] == {}  # step 1 is bitwise equal
    assert step2["attribution"] == {"exp_avg": "1 carried in, 41 equal", "param": "1 carried in, 41 equal"}
    assert "Re-feed in time" in (run_dir / "report.md").read_text()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_stack_refed_from_its_own_state_reproduces_its_plain_run(cases, tmp_path, checkpoints_dir, runner,
                                                                   optimizer):
    """The re-feed's control (issue 29, finding 5): a stack against itself, re-fed from side a's state (its own bits),
    gives its plain run bit for bit at every step and quantity in both modes: loading the state and the gradients
    through the stack's own tensors changes nothing, so a re-fed difference elsewhere is the step's own. For AdamW
    (both moments) and SGD (its momentum buffer: Paddle's accumulator "velocity")."""
    name = f"t_self_{runner}" if optimizer == "adamw" else f"t_sgd_self_{runner}"
    result, run_dir, report, tails = run_train_case(name, cases, tmp_path, checkpoints_dir, oracle=False,
                                                    refeed_ops=True)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, (result.message, tails)
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    assert refeed["faithful"] == {mode: {"checked": [1, 2], "not_reproduced": []} for mode in ("state", "update")}
    assert [s["attribution"] for s in refeed["steps"]] == [{}, {}]
    for mode in ("state", "update"):  # and the re-fed files themselves equal the plain ones, tensor by tensor
        assert _step_bytes(run_dir / f"b-{runner}") == _step_bytes(run_dir / f"b-{runner}-refeed-{mode}")


def _step_bytes(folder):
    from safetensors import safe_open
    out = {}
    for path in sorted((folder / "steps").glob("step*.safetensors")):
        with safe_open(str(path), framework="numpy") as handle:
            out.update({name: handle.get_tensor(name).tobytes() for name in handle.keys()})
    return out


def test_refeed_with_side_a_gradients_shows_megatron_adam_is_torch_adamw(cases, tmp_path, checkpoints_dir):
    """No clipping and the choices aligned: on side a's gradients Megatron's optimizer and torch's AdamW give the same
    moments and parameters bit for bit at every step, so every moment or parameter difference is made by the
    gradients (or carried in), never by the optimizer."""
    result, run_dir, report, tails = run_train_case("t_megatron_hf_aligned", cases, tmp_path, checkpoints_dir,
                                                    oracle=False, refeed_ops=True)
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    for step in refeed["steps"]:
        for quantity in ("exp_avg", "exp_avg_sq", "param"):
            assert "optimizer" not in step["attribution"].get(quantity, ""), (step["step"], step["attribution"])
        assert "made by the step's forward/backward" in step["attribution"]["grad"]
    for step in report["train"]["steps"]:  # torch computes no norm without clipping: none is written as its own
        assert step["scalars"]["grad_norm"] == {"a": None, "b": None, "equal": None, "ulps": None, "unit": "",
                                                "note": "not computed by side b (hf_model)"}
        assert "clip_coeff" not in step["scalars"]
    assert not any("grad_norm" in s["attribution"] for s in refeed["steps"])


def test_knob_matrix_shows_which_knob_removes_which_difference(cases, tmp_path, checkpoints_dir):
    """Megatron moves its routing biases after every step, HF does not: the knob that turns Megatron's update off
    removes those differences, and the matrix says so."""
    from harness.commands import train_matrix

    options = CompareOptions(cases_dir=cases, checkpoints_dir=checkpoints_dir, reports_dir=tmp_path / "reports",
                             oracle=False)
    assert train_matrix.run("t_megatron_hf", options, knobs=[{"expert_bias_update": "off"}]) == 0
    matrix = json.loads(next((tmp_path / "reports").glob("*knob-matrix*/matrix.json")).read_text())
    written, off = matrix["cells"]
    assert written["differing"]["expert_bias"] == 2 and off["differing"]["expert_bias"] == 0
    assert "expert_bias_update = off" in (next((tmp_path / "reports").glob("*knob-matrix*/matrix.md")).read_text())


def test_sgd_on_side_a_gradients_megatron_is_torch_sgd(cases, tmp_path, checkpoints_dir):
    """SGD with momentum, no clipping, the choices aligned: on side a's gradients Megatron's optimizer and
    torch.optim.SGD give the same buffers and parameters bit for bit at every step (measured 2026-12-03: so does the
    research's direct comparison, with clipping and in bf16 too); each stack writes the buffer where its record says."""
    result, run_dir, report, tails = run_train_case("t_sgd_megatron_hf_aligned", cases, tmp_path, checkpoints_dir,
                                                    oracle=False, refeed_ops=True)
    assert result.verdict == "DIFF", (result.message, tails)  # the two models part at step 1's loss on any CPU
    assert report["train"]["order"][5:7] == ["momentum_buffer", "master"]
    assert set(report["train"]["steps"][0]["quantities"]) == {"grad", "momentum_buffer", "param", "expert_bias"}
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    for step in refeed["steps"]:
        for quantity in ("momentum_buffer", "param"):
            assert "optimizer" not in step["attribution"].get(quantity, ""), (step["step"], step["attribution"])
    megatron, hf = (side["meta"] for side in report["sides"][:2])
    assert "state[main_param]['momentum_buffer']" in megatron["state_locations"]["momentum_buffer"]
    assert "torch.optim.SGD" in hf["implementation"] and "inner SGD" in megatron["implementation"]


def test_sgd_paddle_momentum_makes_its_own_parameters_on_side_a_gradients(cases, tmp_path, checkpoints_dir):
    """paddle.optimizer.Momentum's CPU kernel rounds wd·p and lr·buf on their own where torch fuses them (one FMA
    each). On side a's gradients and state (the re-feed's update run) Paddle's step makes other parameters at every
    step, and other buffers for every decayed parameter with a gradient; the 1-D parameters (not decayed: not_1d) get
    Megatron's buffer bits, since buf·momentum + g rounds alike on both (measured 2026-12-03, tiny 2-layer)."""
    import numpy as np

    from harness.case.ops import train_state_names

    result, run_dir, report, tails = run_train_case("t_sgd_megatron_paddle_aligned", cases, tmp_path,
                                                    checkpoints_dir, oracle=False, refeed_ops=True)
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    assert all("made by the optimizer" in step["attribution"]["param"] for step in refeed["steps"]), refeed["steps"]
    a, b = _step_bytes(run_dir / "a-megatron_model"), _step_bytes(run_dir / "b-paddle_model-refeed-update")
    for step in (1, 2):
        for name, shape in train_state_names(TINY_MODEL):
            buffer = f"step{step}.momentum_buffer.{name}"
            gradient = np.frombuffer(a[f"step{step}.grad.{name}"], np.float32)
            if len(shape) == 1:
                assert a[buffer] == b[buffer], buffer
            elif gradient.any():
                assert a[buffer] != b[buffer], buffer
    assert "velocity" in report["sides"][1]["meta"]["state_locations"]["momentum_buffer"]
    assert "paddle.optimizer.Momentum" in report["sides"][1]["meta"]["implementation"]


@pytest.mark.parametrize("runner", ["megatron_model", "paddle_model"])
def test_sgd_negative_control_is_found_at_its_step_in_its_parameter(cases, tmp_path, checkpoints_dir, runner):
    """One bit of one momentum buffer flipped on side b after step 1 (Megatron's torch.optim.SGD state, Paddle's
    "velocity" accumulator): step 1 bitwise, at step 2 exactly that buffer (one element) and its parameter."""
    result, run_dir, report, tails = run_train_case(f"t_sgd_control_{runner}", cases, tmp_path, checkpoints_dir,
                                                    oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    step1, step2 = report["train"]["steps"]
    assert step1["verdict"] == "BITWISE_PASS"
    assert report["train"]["first_divergence"] == {"step": 2, "quantity": "momentum_buffer",
                                                   "tensor": f"step2.momentum_buffer.{TENSOR}"}
    differing = {t["name"] for t in report["tensors"] if t["status"] != "EQUAL" and t["name"].startswith("step2.")}
    assert differing == {f"step2.momentum_buffer.{TENSOR}", f"step2.param.{TENSOR}"}
    buffer = next(t for t in report["tensors"] if t["name"] == f"step2.momentum_buffer.{TENSOR}")
    assert buffer["mismatches"] == 1 and buffer["first_mismatch"]["index"] == [5, 7]


def test_float64_check_judges_the_sgd_buffer_at_every_step(cases, tmp_path, checkpoints_dir):
    """The float64 check of an SGD case (Megatron vs HF, clip 1.0): the buffer carries the clip factor's error
    (Megatron's fp32 norm: 3.0e-8 measured) on side a's gradients, within [megatron.float64_update]'s "step*"."""
    result, run_dir, report, tails = run_train_case("t_sgd_float64", cases, tmp_path, checkpoints_dir, oracle=False)
    semantic = report["train"].get("semantic")
    assert semantic and semantic["ok"], (result.verdict, result.message, tails)
    assert result.verdict == "WITHIN_TOLERANCE", result.message
    names = [t["name"] for t in report["tensors"]]
    update = {"grad_norm", "clip_coeff", "momentum_buffer", "param"}
    parts = {part["judged_by"]: part for part in semantic["parts"]}
    assert parts["side b's optimizer on side a's gradients"]["checked"] == sum(n.split(".")[1] in update
                                                                               for n in names)
    assert any(name.startswith("side b's optimizer on side a's gradients: step1.momentum_buffer.")
               for name in semantic["floors"])


# --- GLM-4.5 MoE (glm4_moe): the training level on another family -------------------------------------------------
# q, k and v are one tensor interleaved per query group on Megatron (linear_qkv) and Paddle (qkv_proj); every state
# tensor of them is its part's rows there (the name map's de-interleave rule). The registry's GLM training cases at
# E2E_TOKENS (16) pin what this CPU gives (AMD EPYC, AVX-512 BF16: docs/training.md has the measurements); a tiny GLM
# trains on every stack to prove the self re-feed.

GLM_TENSOR = "model.layers.0.self_attn.k_proj.weight"  # rows of the fused linear_qkv / columns of qkv_proj


@pytest.fixture(scope="module")
def glm_cases(tmp_path_factory):
    flip = {**FLIP, "tensor": GLM_TENSOR}
    return write_cases(tmp_path_factory.mktemp("glm-train-cases"), *[
        *[tiny_train_case(f"g_self_{runner}", runners=[runner, runner], config={"model": TINY_GLM})
          for runner in RUNNERS],
        tiny_train_case("g_control_paddle", runners=["paddle_model", "paddle_model"], config={"model": TINY_GLM},
                        train={**TINY_TRAIN, "flip": flip}),
    ])


def _glm(name, tmp_path, checkpoints_dir, **options):
    result, run_dir = compare_case(name, CompareOptions(tokens=E2E_TOKENS, checkpoints_dir=checkpoints_dir,
                                                        reports_dir=tmp_path / "reports", **options))
    report = json.loads((run_dir / "report.json").read_text())
    tails = "\n".join(s["stderr_tail"][-2500:] for s in report["sides"] if s["status"] != "ok")
    return result, run_dir, report, tails


# The first divergence on this CPU (AMD EPYC, AVX-512 BF16) at E2E_TOKENS: step 1 on every pair, at the loss when it
# rounds apart (1 ULP), else at the first gradient backward makes (lm_head's). At 64 tokens it is the other way round
# (docs/training.md): which of the two is platform and size arithmetic; that it is step 1 is by construction.
GLM_FIRST = {"glm4_moe_2layer_train": "step1.grad.lm_head.weight", "glm4_moe_2layer_train_paddle": "step1.loss"}


@pytest.mark.slow  # GLM-4.5's training cases: a family sweep, as tests/test_train_zoo_e2e.py
@pytest.mark.parametrize("case, runners", [("glm4_moe_2layer_train", "megatron_model,hf_model"),
                                           ("glm4_moe_2layer_train_paddle", "megatron_model,paddle_model")])
def test_glm4_moe_training_pairs_part_at_step_1_and_keep_the_routing_bias(case, runners, tmp_path, checkpoints_dir):
    """Megatron-Core vs HF and vs PaddleFormers on GLM-4.5's 2-layer shape: DIFF at every step, first at step 1 (the
    model level's numerics); the lr equal at every step; at step 1 (lr 0) every parameter equal, and the routing bias
    at every step (no stack moves GLM-4.5's: Megatron Bridge's rate is 0); the gradients equal at a step are exactly
    the idle experts' zeros. The truth runs (HF in float64) and judges every step."""
    result, run_dir, report, tails = _glm(case, tmp_path, checkpoints_dir, oracle=runners.endswith("hf_model"))
    assert result.verdict == "DIFF" and result.expectation["met"], (result.message, tails)
    train = report["train"]
    assert train["parameters"] == 282 and [s["verdict"] for s in train["steps"]] == ["DIFF"] * 3
    assert train["first_divergence"]["step"] == 1, train["first_divergence"]
    if on_amd_avx512_bf16():  # which tensor of step 1 rounds apart first is platform arithmetic (above)
        assert train["first_divergence"]["tensor"] == GLM_FIRST[case], train["first_divergence"]
    for step in train["steps"]:
        assert step["scalars"]["lr"]["equal"] and step["quantities"]["expert_bias"]["differing"] == []
        equal = {t["name"] for t in report["tensors"] if t["name"].startswith(f"step{step['step']}.grad.")
                 and t["status"] == "EQUAL"}
        assert equal and all(".mlp.experts." in name for name in equal)
    assert train["steps"][0]["quantities"]["param"]["equal"] == 282
    stated = Registry.load().get(case)
    known, table = committed_record(stated)  # this platform's record pins every tensor's counts and bits
    if known is not None:
        assert_repeats_the_record(stated, report, table)
    if runners.endswith("hf_model"):
        assert set(train["steps"][2]["truth"]) >= {"grad", "exp_avg", "param", "loss"}
    else:  # Paddle's GLM MoE calls only the experts with tokens: the others have no gradient there, named per step
        assert report["sides"][1]["meta"]["zero_grads"]["step 1"]


@pytest.mark.slow  # GLM-4.5's training cases: a family sweep, as tests/test_train_zoo_e2e.py
def test_glm4_moe_training_control_is_found_in_its_part_of_the_fused_qkv(tmp_path, checkpoints_dir):
    """One bit of exp_avg[5, 7] of layer 0's k_proj, which Megatron holds as rows of linear_qkv, flipped on side b
    after step 1: step 1 bitwise, and at step 2 exactly that exp_avg (one element, at [5, 7]) and that parameter,
    not q_proj's or v_proj's rows of the same fused tensor; the re-feed says both were carried in."""
    result, run_dir, report, tails = _glm("glm4_moe_2layer_train_control_megatron", tmp_path, checkpoints_dir,
                                          oracle=False, refeed_ops=True)
    assert result.verdict == "DIFF" and result.expectation["met"] and result.exit_code == 0, (
        result.message, result.expectation, tails)
    rows = {t["name"]: t for t in report["tensors"]}
    flipped = rows[f"step2.exp_avg.{GLM_TENSOR}"]
    assert flipped["mismatches"] == 1 and flipped["first_mismatch"]["index"] == [5, 7]
    assert rows[f"step2.param.{GLM_TENSOR}"]["mismatches"] == 1
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok" and refeed["steps"][1]["attribution"] == {
        "exp_avg": "1 carried in, 281 equal", "param": "1 carried in, 281 equal"}, refeed


@pytest.mark.slow  # GLM-4.5's training cases: a family sweep, as tests/test_train_zoo_e2e.py
def test_glm4_moe_paddle_control_is_found_in_its_columns_of_qkv_proj(glm_cases, tmp_path, checkpoints_dir):
    """The same flip on Paddle, which holds k_proj as columns of its transposed, interleaved qkv_proj: found at step 2
    in exactly that exp_avg element and that parameter."""
    result, run_dir, report, tails = run_train_case("g_control_paddle", glm_cases, tmp_path, checkpoints_dir,
                                                    oracle=False)
    assert result.verdict == "DIFF", (result.message, tails)
    assert report["train"]["steps"][0]["verdict"] == "BITWISE_PASS"
    differing = {t["name"] for t in report["tensors"] if t["status"] != "EQUAL" and t["name"].startswith("step2.")}
    assert differing == {f"step2.exp_avg.{GLM_TENSOR}", f"step2.param.{GLM_TENSOR}"}
    flipped = next(t for t in report["tensors"] if t["name"] == f"step2.exp_avg.{GLM_TENSOR}")
    assert flipped["mismatches"] == 1 and flipped["first_mismatch"]["index"] == [5, 7]


@pytest.mark.parametrize("case, runners", [("glm4_moe_2layer_train_float64", ("megatron_model", "hf_model")),
                                           ("glm4_moe_2layer_train_float64_dense",
                                            ("megatron_model", "paddle_model")),
                                           ("glm4_moe_2layer_train_float64_dense", ("paddle_model", "hf_model"))])
@pytest.mark.slow  # GLM-4.5's training cases: a family sweep, as tests/test_train_zoo_e2e.py
def test_glm4_moe_float64_check_judges_every_step(case, runners, tmp_path, checkpoints_dir):
    """The float64 check of every step on GLM-4.5 (plain run, re-fed, optimizer on side a's gradients): every pair
    within the floors its stacks state, the q/k/v parts of the fused tensors included. PaddleFormers' MoE refuses
    float64: its pairs run with both layers dense."""
    result, run_dir, report, tails = _glm(case, tmp_path, checkpoints_dir, oracle=False, runners=runners)
    semantic = report["train"].get("semantic")
    assert semantic, (result.verdict, result.message, tails)
    assert semantic["ok"], f"mapping error: {semantic['first_mismatch']}: {semantic['tensors_beyond'][:3]}"
    assert result.verdict == "WITHIN_TOLERANCE" and report["train"]["refeed"]["status"] == "ok", result.message
    assert [part["checked"] > 0 for part in semantic["parts"]] == [True] * 3
    checked = {t["name"] for t in report["tensors"]}
    assert f"step3.exp_avg.{GLM_TENSOR}" in checked and "step3.param.model.layers.1.self_attn.q_proj.bias" in checked


@pytest.mark.slow  # GLM-4.5's training cases: a family sweep, as tests/test_train_zoo_e2e.py
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_glm4_moe_stack_refed_from_its_own_state_reproduces_its_plain_run(glm_cases, tmp_path, checkpoints_dir,
                                                                            runner):
    """The re-feed's control on GLM-4.5: each stack loads side a's state (its own bits) through the family's name map
    (Megatron: q, k and v into their rows of linear_qkv; Paddle: into their columns of qkv_proj, and nothing into an
    expert no token has reached, which has no gradient or state there yet) and gives its plain run bit for bit at
    every step in both modes."""
    result, run_dir, report, tails = run_train_case(f"g_self_{runner}", glm_cases, tmp_path, checkpoints_dir,
                                                    oracle=False, refeed_ops=True)
    assert result.verdict == "BITWISE_PASS" and result.exit_code == 0, (result.message, tails)
    refeed = report["train"]["refeed"]
    assert refeed["status"] == "ok", (refeed["reason"], tails)
    assert refeed["faithful"] == {mode: {"checked": [1, 2], "not_reproduced": []} for mode in ("state", "update")}
    for mode in ("state", "update"):
        assert _step_bytes(run_dir / f"b-{runner}") == _step_bytes(run_dir / f"b-{runner}-refeed-{mode}")
    if runner == "paddle_model":  # the re-feed met parameters without a gradient (experts no token reached)
        assert report["sides"][1]["meta"]["zero_grads"]["step 1"]


@pytest.mark.slow  # two 3-step float64 training runs with their re-feeds: 30 s on 2 cores
def test_a_night_runs_the_re_fed_runs_beside_the_pair_and_judges_alike(cases, tmp_path, checkpoints_dir):
    """Issue 47: minimax_m2_2layer_train_float64 peaked at 3.17 GB, since its re-fed runs of side b started after the
    pair and read every step of side a, which stayed whole until they ended. With keep_tensors off (a night's), they
    run beside the pair: side a holds no more than one whole step besides its first divergence (step 1) at any time,
    the re-fed runs one whole step between them past step 1, and each re-fed run's tensor files go once it is
    compared; the verdict, the per-step records and the re-feed's attribution are those of a run that keeps them."""
    import threading
    import time

    from tests.support.train import whole_steps

    kept, _, kept_report, tails = run_train_case("t_float64_night", cases, tmp_path / "kept", checkpoints_dir,
                                                 oracle=False)
    most, beside, done = {}, [], threading.Event()

    def watch():
        while not done.is_set():
            for run_dir in (tmp_path / "gone" / "reports").glob("*"):
                held = {folder.name: [name for name in whole_steps(folder) if name != "step00001.safetensors"]
                        for folder in run_dir.glob("*-*")}
                refed = [name for folder, names in held.items() if "refeed" in folder for name in names]
                for name, count in [*((folder, len(names)) for folder, names in held.items()), ("refed", len(refed))]:
                    most[name] = max(most.get(name, 0), count)
                if list(run_dir.glob("b-*-refeed-*/steps/step*.safetensors")) and not list(
                        run_dir.glob("a-*/steps/step00003.safetensors")):
                    beside.append(True)  # a re-fed step written before side a's last step
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    gone, run_dir, gone_report, _ = run_train_case("t_float64_night", cases, tmp_path / "gone", checkpoints_dir,
                                                   oracle=False, keep_tensors=False)
    done.set()
    watcher.join()
    assert kept.verdict == gone.verdict == "WITHIN_TOLERANCE", (kept.message, tails)
    for field in ("tensors", "first_divergence", "message"):
        assert gone_report[field] == kept_report[field], field
    def without_runs(report, part):  # the re-fed runs' own records (folders, seconds) differ from run to run
        return {k: v for k, v in part(report).items() if k not in ("refeed", "runs")}

    for part in (lambda report: report["train"], lambda report: report["train"]["refeed"]):
        assert without_runs(gone_report, part) == without_runs(kept_report, part)
    assert kept_report["train"]["first_divergence"]["step"] == 1 and beside
    assert max(most.values()) <= 1 and "a-megatron_model" in most, most
    refed = sorted(path.name for path in run_dir.glob("b-*-refeed-*"))
    assert refed == ["b-hf_model-refeed-state", "b-hf_model-refeed-update"]
    assert not list(run_dir.glob("b-*-refeed-*/**/*.safetensors"))
    assert whole_steps(run_dir / "a-megatron_model") == ["step00001.safetensors"]  # the first divergence's
    assert len(list(run_dir.glob("a-*/steps/*.safetensors"))) == 3  # the pair's step files stay for the night's prune


def _run_planted(cases, tmp_path, checkpoints_dir, folder: str, keep: bool):
    """t_float64_night with hf_model's run in `folder` failing as it writes step 2 (tests/support/doubles.py), its
    tensors kept or followed as a night's: the result, report.json, and the pids of every hf_model process it
    started."""
    from tests.support.doubles import ends_before_step, python_with_startup

    pids = tmp_path / f"pids-{keep}"
    pids.mkdir()
    python = python_with_startup(tmp_path, f"planted-{keep}", ends_before_step(folder, 2, pids))
    result, _, report, _ = run_train_case("t_float64_night", cases, tmp_path / f"kept-{keep}", checkpoints_dir,
                                          oracle=False, pythons={"hf_model": python}, fresh_process=True,
                                          keep_tensors=keep)
    return result, report, sorted(int(path.name) for path in pids.iterdir())


@pytest.mark.slow  # the 3-step float64 case, its tensors kept and followed: 45 s on 2 cores
def test_a_re_fed_run_that_ends_early_beside_the_pair_fails_the_re_feed_as_after_it(cases, tmp_path,
                                                                                   checkpoints_dir):
    """Issue 47: a night's re-fed run that ends part way while it runs beside the pair (the state run fails as it
    writes step 2) is followed no further: nothing waits on it, the case ends ERROR naming the re-feed's failure, and
    the pair's records, the verdict and the message are those of the re-fed runs run after the pair (one run of side
    b and the state run there; the update run too beside the pair). Each run is a process of its own, as
    ``fresh_process`` asks (the re-fed runs went to the pool's workers, which outlived the case), and none is left."""
    from tests.support.doubles import alive

    kept, kept_report, kept_pids = _run_planted(cases, tmp_path, checkpoints_dir, "b-hf_model-refeed-state", True)
    gone, gone_report, gone_pids = _run_planted(cases, tmp_path, checkpoints_dir, "b-hf_model-refeed-state", False)
    assert kept.verdict == gone.verdict == "ERROR" and gone.exit_code == 2, gone.message
    assert gone.message == kept.message
    assert gone.message == ("float64 check of every step could not judge steps 2 on: re-feed error: re-fed side b "
                            "(state): exited with code 1"), gone.message
    for field in ("tensors", "first_divergence"):
        assert gone_report[field] == kept_report[field], field
    for part in ("status", "reason"):
        assert gone_report["train"]["refeed"][part] == kept_report["train"]["refeed"][part], part
    assert "planted fault ends this run as it writes step 2" in gone_report["train"]["refeed"]["runs"]["state"][
        "stderr_tail"]
    assert (len(kept_pids), len(gone_pids)) == (2, 3)
    assert not any(alive(pid, wait=0.5) for pid in kept_pids + gone_pids)  # each run a process of its own


@pytest.mark.slow  # the 3-step float64 case, its tensors kept and followed: 30 s on 2 cores
def test_a_side_that_ends_early_ends_the_re_fed_runs_beside_it(cases, tmp_path, checkpoints_dir):
    """Issue 47: side b of a night's float64 case fails as it writes step 2, after its re-fed runs started beside
    the pair and read step 1: every run is released, the re-fed runs end with it (none waits on a step that will not
    come, no process is left), and the case ends ERROR naming side b, as when the re-fed runs run after the pair (they
    do not run there)."""
    from tests.support.doubles import alive

    kept, _, kept_pids = _run_planted(cases, tmp_path, checkpoints_dir, "b-hf_model", True)
    gone, gone_report, gone_pids = _run_planted(cases, tmp_path, checkpoints_dir, "b-hf_model", False)
    assert kept.verdict == gone.verdict == "ERROR" and gone.exit_code == 2, gone.message
    assert gone.message == kept.message and "runner b (hf_model) failed" in gone.message, gone.message
    assert "planted fault ends this run as it writes step 2" in gone_report["sides"][1]["stderr_tail"]
    assert (len(kept_pids), len(gone_pids)) == (1, 3)
    assert not any(alive(pid, wait=0.5) for pid in kept_pids + gone_pids)


@pytest.mark.slow  # a 4-step pair with its float64 truth, twice: 25 s on 2 cores
def test_a_night_judges_each_step_as_it_is_written_and_holds_one_step_at_most(cases, tmp_path, checkpoints_dir):
    """Issue 47: a night's training case held every step of both sides and of its truth until the runners ended (the
    MiniMax-M2 pair peaked at 3.71 GB). Followed (keep_tensors off, a night's), each step is judged as soon as the
    three runs wrote it and its tensors go at once (what the next step's checks read of it held in memory): no run
    holds more than one whole step besides the pair's first divergence at any time, the truth none at the end, and
    the verdict, the per-step records, the truth's check and the distances from it are those of a run that keeps
    every tensor."""
    import threading
    import time

    from tests.support.train import whole_steps

    kept, _, kept_report, tails = run_train_case("t_night_follow", cases, tmp_path / "kept", checkpoints_dir)
    most, done = {}, threading.Event()

    def watch():
        while not done.is_set():
            for folder in (tmp_path / "gone" / "reports").glob("*/*-*"):
                held = [name for name in whole_steps(folder) if name != "step00001.safetensors"]
                most[folder.name] = max(most.get(folder.name, 0), len(held))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    gone, run_dir, gone_report, _ = run_train_case("t_night_follow", cases, tmp_path / "gone", checkpoints_dir,
                                                   keep_tensors=False)
    done.set()
    watcher.join()
    assert kept.verdict == gone.verdict == "DIFF", (kept.message, tails)
    for field in ("tensors", "first_divergence", "message", "train", "expectation"):
        assert gone_report[field] == kept_report[field], field
    assert gone_report["train"]["truth"]["check"]["checked"] == [1, 2, 3, 4]
    assert sorted(most) == ["a-megatron_model", "b-hf_model", "oracle-hf_model-float64"]
    assert max(most.values()) <= 1 and kept_report["train"]["first_divergence"]["step"] == 1
    for folder in ("a-megatron_model", "b-hf_model"):
        assert whole_steps(run_dir / folder) == ["step00001.safetensors"], folder
    assert whole_steps(run_dir / "oracle-hf_model-float64") == []
