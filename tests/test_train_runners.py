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
from harness.run.orchestrate import _request  # noqa: E402
from harness.run.protocol import Phases  # noqa: E402
from tests.support.cases import registry_from  # noqa: E402
from tests.support.train import tiny_train_case  # noqa: E402


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
