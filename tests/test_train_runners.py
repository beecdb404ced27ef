"""The training runners' own parts, in process on a tiny model: each of Megatron's CPU training adapters is needed
(without it Megatron's own code refuses to run, with the error it raises), and the observers record the factor the
stack really applied (clipped gradient = unclipped gradient x the observed factor, bit for bit)."""

import json
import os

import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from harness.case import checkpoints  # noqa: E402
from harness.case.train_settings import Flip  # noqa: E402
from harness.run.orchestrate import _request  # noqa: E402
from harness.run.protocol import Phases  # noqa: E402
from tests.support.cases import registry_from  # noqa: E402
from tests.support.installed import megatron_has_dsa_switches  # noqa: E402
from tests.support.train import tiny_train_case  # noqa: E402


@pytest.fixture(autouse=True)
def _cell():
    """Each test one cell: the runner's patches (e.g. cpu_current_stream) undone after it, as a worker undoes them."""
    from harness.run.cell_state import patches_undone

    with patches_undone():
        yield


@pytest.fixture(scope="module")
def requests(tmp_path_factory):
    """A tiny training request per dtype (float32, float64) on its own checkpoint."""
    folder = tmp_path_factory.mktemp("train-request")
    made = {}
    for dtype in ("float32", "float64"):
        (folder / dtype).mkdir()
        case = registry_from(folder / dtype, tiny_train_case(dtype=dtype)).get("tiny_train")
        checkpoint = checkpoints.prepare(case, folder / "checkpoints")
        made[dtype] = _request(case, checkpoint.files, "cpu", folder / "out", 1)
    return made


@pytest.mark.parametrize("adapter, dtype, error, where", [
    # torch refuses the literal device="cuda" of Megatron's buffers
    ("cuda_factory_to_cpu", "float32", "Torch not compiled with CUDA enabled", "torch/cuda/__init__.py"),
    # clip_grads.py: assert param.grad.type() == 'torch.cuda.FloatTensor' (a bare assert: no message)
    ("tensor_type_cuda_names", "float32", "", "megatron/core/optimizer/clip_grads.py"),
    # the same assert, for float64 main grads
    ("float64_as_fp32_type_name", "float64", "", "megatron/core/optimizer/clip_grads.py"),
    # megatron-core >= 0.19's start_grad_sync: torch.cuda.current_stream() (0.16 never asks)
    pytest.param("cpu_current_stream", "float32", "Torch not compiled with CUDA enabled", "torch/cuda/__init__.py",
                 marks=pytest.mark.skipif(not megatron_has_dsa_switches(), reason="megatron-core < 0.19")),
])
def test_each_megatron_training_adapter_is_needed(requests, tmp_path, adapter, dtype, error, where):
    from harness.runners.megatron import train
    from harness.runners.megatron.runner import reset

    request = {**requests[dtype], "output_dir": str(tmp_path / "out")}
    try:
        with pytest.raises((AssertionError, RuntimeError), match=error) as raised:
            train.run(request, Phases(), skip_adapters={adapter})
    finally:
        reset()
    assert raised.traceback[-1].path.as_posix().endswith(where), raised.traceback[-1]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_megatron_trains_with_its_adapters_and_writes_every_step(requests, tmp_path, dtype):
    from harness.run.steps import read_header, step_file
    from harness.runners.megatron import train
    from harness.runners.megatron.runner import reset

    request = {**requests[dtype], "output_dir": str(tmp_path / "out")}
    try:
        meta = train.run(request, Phases())
    finally:
        reset()
    expected = {"cuda_factory_to_cpu", "tensor_type_cuda_names", "clip_scale"} | (
        {"float64_as_fp32_type_name"} if dtype == "float64" else set())
    assert {a["name"] for a in meta["adapters"]} >= expected
    header = read_header(step_file(tmp_path / "out", 2))
    assert header.kept and header.layouts["step2.param.lm_head.weight"][0] == dtype
    json.dumps(meta)  # meta.json must be writable


def test_a_bare_loop_trains_without_observing_or_writing(requests, tmp_path):
    """bench_speed's bare loop: Megatron's calls only; no step file, no observer."""
    from harness.run.steps import step_file
    from harness.runners.megatron import train
    from harness.runners.megatron.runner import reset

    request = requests["float32"]
    request = {**request, "output_dir": str(tmp_path / "out"),
               "config": {**request["config"], "train": {**request["config"]["train"], "bare": True}}}
    phases = Phases()
    try:
        train.run(request, phases)
    finally:
        reset()
    assert "step 2" in phases.seconds
    assert not step_file(tmp_path / "out", 1).exists() and not step_file(tmp_path / "out", 2).exists()


def test_megatron_clip_scale_observer_sees_the_factor_megatron_multiplies_by():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from harness.runners.megatron.train import CudaOnCpu, clip_scale

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.tensor([3.0, -4.0, 12.0])
    before = param.grad.clone()
    with CudaOnCpu(), clip_scale() as seen:
        clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=13.0)
    assert len(seen) == 1 and torch.equal(param.grad, before * seen[0])
    with CudaOnCpu(), clip_scale() as seen:  # a coefficient >= 1 scales nothing: nothing observed (the step: 1)
        clip_grad_by_total_norm_fp32([param], max_norm=100.0, total_norm=1.0)
    assert seen == []


def test_megatron_applies_its_double_clip_coefficient_rounded_to_the_gradients_dtype():
    """What megatron_model writes as its clip factor (issue 29, finding 6): clip_grad_by_total_norm_fp32 hands a Python
    double to local_multi_tensor_scale, whose `grad * scale` torch computes at the gradient's precision: fp32 grads
    are multiplied by float32(scale) exactly, which the double product would not give."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from harness.runners.megatron.train import CudaOnCpu, clip_scale

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.ones(4096))
    param.grad = torch.randn(4096)
    before = param.grad.clone()
    with CudaOnCpu(), clip_scale() as seen:
        clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=3.3)
    scale = seen[0]
    assert isinstance(scale, float)
    assert torch.equal(param.grad.view(torch.int32), (before * torch.tensor(scale, dtype=torch.float32))
                       .view(torch.int32))
    assert not torch.equal(param.grad, (before.double() * scale).float())  # not a double product


def test_torch_clip_factor_observer_sees_the_factor_clip_grad_norm_applies():
    from harness.runners.torch.hf_train import ClipFactor

    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 2))]
    params[0].grad, params[1].grad = torch.tensor([1.0, -2.0, 3.0, 0.5]), torch.tensor([[4.0, 1.0], [-1.0, 2.0]])
    before = [p.grad.clone() for p in params]
    with ClipFactor() as observer:
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
    factor = observer.factor()
    assert 0 < float(factor) < 1 and norm > 1
    assert all(torch.equal(p.grad, g * factor) for p, g in zip(params, before, strict=True))


def test_paddle_clip_observer_sees_the_norm_and_the_factor_paddle_applies():
    paddle = pytest.importorskip("paddle")
    import numpy as np

    from harness.runners.paddle.train import clip_norm_and_factor

    x = paddle.create_parameter([3], "float32")
    clip = paddle.nn.ClipGradByGlobalNorm(1.0)
    before = np.array([3.0, -4.0, 12.0], dtype=np.float32)
    with clip_norm_and_factor(clip) as seen:
        (_, clipped), = clip([(x, paddle.to_tensor(before))])
    assert len(seen["sqrt"]) == 1 and len(seen["divide"]) == 1
    assert float(seen["sqrt"][0].reshape(())) == 13.0
    assert np.array_equal(clipped.numpy(), before * seen["divide"][0].reshape(()))
    assert "_dygraph_clip" not in vars(clip)  # the observer is gone afterwards


# --- Megatron's state of a fused tensor (GLM-4.5's linear_qkv) in canonical names -----------------------------------

GROUPS, WIDTHS, COLUMNS = 2, (2, 1, 1), 3  # 2 query groups of 2 q rows, 1 k row, 1 v row; 3 columns


def _fused_states(ranges=None):
    """MegatronStates over one fused [8, 3] parameter that holds q [4, 3], k [2, 3] and v [2, 3] interleaved per query
    group, with an FP32Optimizer-like owner (`ranges` None) or a distributed optimizer holding elements
    [start, end) of its flattening."""
    from types import SimpleNamespace

    from harness.families.names import Rule
    from harness.runners.megatron.train import MegatronStates

    model = torch.nn.Module()
    model.fused = torch.nn.Parameter(torch.arange(24, dtype=torch.float32).view(8, 3))
    canonical = ("q.weight", "k.weight", "v.weight")
    names = {"parameters": {n: ("fused", list(canonical)) for n in canonical}, "buffers": {},
             "parts": {n: Rule("deinterleave", ("fused",), i, groups=GROUPS, widths=WIDTHS)
                       for i, n in enumerate(canonical)}}
    state = {"exp_avg": 1000 + torch.arange(24, dtype=torch.float32).view(8, 3)}
    if ranges is None:
        inner = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"params": [model.fused]}],
                                                          state={model.fused: state}))
    else:
        start, end = ranges
        flat = state["exp_avg"].view(-1)[start:end]
        inner = SimpleNamespace(
            model_param_group_index_map={model.fused: (0, 0)}, optimizer=SimpleNamespace(param_groups=[]),
            _get_model_param_range_map=lambda p: {"param": SimpleNamespace(start=start, end=end)},
            _get_main_param_and_optimizer_states=lambda p: {"exp_avg": flat})
    shapes = {"q.weight": (4, 3), "k.weight": (2, 3), "v.weight": (2, 3)}
    return MegatronStates(names, model, SimpleNamespace(chained_optimizers=[inner]), shapes), model, state


def test_megatron_state_of_a_fused_tensor_is_its_parts_rows_by_the_name_maps_rule():
    """q, k and v of a fused linear_qkv: each quantity is the rows the name map's de-interleave rule names (the rule
    the model level takes its gradient with), read as views of Megatron's tensor and written back into those rows
    only; a planted flip lands in its part's row."""
    from harness.capture.torch import apply_rule

    states, model, state = _fused_states()
    for name, rule in states.parts.items():
        assert torch.equal(states.whole("param", name), apply_rule(rule, [model.fused.detach()]))
        assert torch.equal(states.whole("exp_avg", name), apply_rule(rule, [state["exp_avg"]]))
    # fused rows: group 0 = q0 q1 k0 v0 (rows 0-3), group 1 = q2 q3 k1 v1 (rows 4-7)
    assert [(s, e) for s, e, _ in states.pieces("exp_avg", "k.weight")] == [(0, 3), (3, 6)]
    before = state["exp_avg"].clone()
    states.put("exp_avg", "k.weight", torch.full((2, 3), -1.0))
    changed = (state["exp_avg"] != before).any(dim=1).nonzero().flatten().tolist()
    assert changed == [2, 6] and torch.equal(state["exp_avg"][[2, 6]], torch.full((2, 3), -1.0))
    flipped = state["exp_avg"].clone()
    states.flip(Flip(side="b", after_step=1, state="exp_avg", tensor="v.weight", index=(1, 2), bit=20))
    differs = (state["exp_avg"] != flipped).nonzero().tolist()
    assert differs == [[7, 2]]  # v's row 1 is the fused row 7


def test_megatron_state_of_a_fused_tensor_under_a_distributed_optimizer_splits_into_pieces():
    """A distributed optimizer's range of the flattened fused tensor meets each part in pieces (per query group):
    each piece is where the part has those elements, and two ranks' pieces tile every part exactly."""
    from harness.runners.torch import ranks

    held = {}
    for start, end in ((0, 10), (10, 24)):
        states, model, state = _fused_states((start, end))
        for name in states.parts:
            held.setdefault(name, []).extend((s, e, v.clone()) for s, e, v in states.pieces("exp_avg", name))
    whole, _, full = _fused_states()
    for name, pieces in held.items():
        assert torch.equal(ranks.assemble(name, whole.shapes[name], pieces), whole.whole("exp_avg", name))
    # rank 0's range [0, 10) of the fused [8, 3]: rows 0-2 and one element of row 3; q's rows 0-1, k's row 0 (fused
    # row 2), v's first element (fused row 3)
    states, _, _ = _fused_states((0, 10))
    assert [(s, e) for s, e, _ in states.pieces("exp_avg", "q.weight")] == [(0, 6)]
    assert [(s, e) for s, e, _ in states.pieces("exp_avg", "k.weight")] == [(0, 3)]
    assert [(s, e) for s, e, _ in states.pieces("exp_avg", "v.weight")] == [(0, 1)]
