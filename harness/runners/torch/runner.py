"""Plain-PyTorch runner: the linear ops written with torch functions, no Megatron (imports torch + safetensors).

It shows whether a difference comes from Megatron's wrapping or from the kernels underneath, and it proves the
runner boundary is open to a third framework. The weight layout is the runner's choice, by name:

- ``torch``: weight ``[out, in]`` (Megatron's), forward ``F.linear(x, W)`` = ``x @ W.t()`` (the TN GEMM),
  dgrad ``dy @ W``, wgrad ``dy.t() @ x``: the same torch calls Megatron's layer makes at TP=1.
- ``torch_nn`` (``python -m harness.runners.torch_nn``): weight made contiguous as ``[in, out]`` (Paddle's),
  forward ``x @ W`` (the NN GEMM), dgrad ``dy @ W.t()``, wgrad ``x.t() @ dy``, as Paddle's gated path does;
  the weight grad is transposed back to ``[out, in]`` (exact).

The backward is explicit (three named matmuls, no autograd), so the report says exactly which GEMMs ran; the
bias, where a case has one, is added after the GEMM and its grad is ``dy.sum(0)``, as in Megatron's layer.
Device setup and determinism settings are shared with the Megatron runner (``torch_env``).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.case import ops  # noqa: E402
from harness.case.ops import OPS  # noqa: E402
from harness.run.protocol import OUTPUTS, Phases, Unsupported, serve  # noqa: E402
from harness.runners.torch import env as torch_env  # noqa: E402

LAYOUTS = {
    "tn": "weight [out, in]; forward F.linear(x, W) (TN GEMM); dgrad dy @ W; wgrad dy.t() @ x",
    "nn": "weight [in, out] (contiguous); forward x @ W (NN GEMM); dgrad dy @ W.t(); wgrad x.t() @ dy, "
          "transposed back to [out, in]",
}


def runner(layout: str):
    """The `run` function of the runner for one weight layout ("tn" or "nn")."""

    def run(request: dict, phases: Phases) -> dict:
        implementation_of = IMPLEMENTATIONS.get(OPS[request["op"]])
        if implementation_of is None:
            covered = ", ".join(op.name for op in IMPLEMENTATIONS)
            raise Unsupported(f"the plain-PyTorch runner has no op {request['op']!r} (it has {covered})")
        if request["tp"] != 1:
            raise Unsupported(f"the plain-PyTorch runner runs single-device ops only (tp=1), got tp={request['tp']}")
        with phases("setup"):
            device = torch_env.select_device(request["device"])
            determinism = torch_env.apply_determinism(device)
            tensors = torch_env.load_inputs(request["checkpoint"], device)
        outputs = implementation_of(tensors, layout, device, phases)
        with phases("write"):
            save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()},
                      os.path.join(request["output_dir"], OUTPUTS))
        return {"framework": "pytorch", "versions": {"torch": torch.__version__}, "weight_layout": layout,
                "implementation": f"plain torch ({layout.upper()}): {LAYOUTS[layout]}; explicit backward, "
                                  "no autograd", "determinism": determinism, **torch_env.provenance(device)}

    return run


def linear(tensors: dict, layout: str, device: torch.device, phases: Phases) -> dict:
    x, dy, bias = tensors["input"], tensors["grad_output"], tensors.get("bias")
    w = tensors["weight"] if layout == "tn" else tensors["weight"].t().contiguous()
    with phases("forward"):
        out = F.linear(x, w) if layout == "tn" else torch.matmul(x, w)
        if bias is not None:
            out = out + bias
        torch_env.synchronize(device)
    with phases("backward"):
        if layout == "tn":
            grad_input, grad_weight = dy.matmul(w), dy.t().matmul(x)
        else:
            grad_input, grad_weight = dy.matmul(w.t()), x.t().matmul(dy).t()
        outputs = {"out": out, "grad.input": grad_input, "grad.weight": grad_weight}
        if bias is not None:
            outputs["grad.bias"] = dy.sum(dim=0)
        torch_env.synchronize(device)
    return outputs


# Column- and row-parallel linears are the same single-device math at TP=1.
IMPLEMENTATIONS = {ops.COLUMN_PARALLEL_LINEAR: linear, ops.ROW_PARALLEL_LINEAR: linear}


def probe(device: str) -> dict:
    """What would run here (``--probe``): torch's version and CPU capability, and each op's function."""
    from harness.run.protocol import op_table

    return {"framework": "torch", "versions": {"torch": torch.__version__}, "importable": True,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cuda_available": torch.cuda.is_available(), "ops": op_table(IMPLEMENTATIONS, "torch")}


def main() -> None:
    serve("torch", runner("tn"), probe, torch_env.release, torch_env.cell_state)
