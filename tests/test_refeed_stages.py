"""Re-feed runs each stage of a block as the side's implementation of the block runs it.

PaddleFormers' shared expert (``DeepseekV3MLP``, fuse_up_gate=False) computes fc1 as two GEMMs, gate_proj and
up_proj; the linear op alone is one GEMM. Re-feeding fc1 as one GEMM once reported fc1_out "carried in" on a CPU
where the two shapes' MKL kernels round differently (Intel Xeon with AMX: the e2e case
kimi_shared_mlp_fp32_paddleformers). The stage's request names its block (``refeed_stage``), and the PaddleFormers
level then runs gate_proj and up_proj.
"""

import numpy as np

from harness.case.ops import OPS, REFEED_STAGE
from harness.case.registry import Registry
from tests.support.installed import require

require("paddleformers")  # the real PaddleFormers level


class Phases:
    def __call__(self, name):
        from contextlib import nullcontext

        return nullcontext()


def run_fc1(config):
    from harness.runners.paddle import formers

    assert formers._import_problem() is None  # imports PaddleFormers as the level does (the paddlefleet_ops shim)
    rng = np.random.default_rng(0)
    h, f, tokens = 64, 48, 16
    tensors = {"input": rng.standard_normal((tokens, h)).astype(np.float32),
               "weight": (rng.standard_normal((2 * f, h)) * 0.02).astype(np.float32),
               "grad_output": (rng.standard_normal((tokens, 2 * f)) * 0.01).astype(np.float32)}
    request = {"op": "column_parallel_linear", "dtype": "float32", "device": "cpu", "tp": 1, "tokens": tokens,
               "shapes": {"input_size": h, "output_size": 2 * f},
               "config": OPS["column_parallel_linear"].resolve({**config, "paddle_impl": "paddleformers"})}
    return formers.linear(request, tensors, True, Phases(), lambda call, kernel, request: call())


def test_the_stage_request_names_its_block():
    case = Registry.load().cases["kimi_shared_mlp_fp32_paddleformers"]
    names = [stage.name for stage in case.op_spec.stages(case.shapes, case.config)]
    assert names == ["fc1", "act", "fc2"]  # refeed.run sends f"{case.op}.{stage.name}" as REFEED_STAGE


def test_paddleformers_runs_the_shared_experts_fc1_stage_as_two_gemms():
    fused, fused_name = run_fc1({})
    split, split_name = run_fc1({REFEED_STAGE: "shared_expert_mlp.fc1"})
    assert "gate_proj and up_proj" in split_name and "gate_proj" not in fused_name
    f = fused["out"].shape[1] // 2
    for name in ("out", "grad.weight", "grad.input"):  # the same function: equal to fp32 rounding
        np.testing.assert_allclose(split[name], fused[name], rtol=1e-4, atol=1e-6, err_msg=name)
    assert split["out"].shape == fused["out"].shape and split["grad.weight"].shape == (2 * f, 64)
