"""Paddle runner: the Paddle side of every op, at the highest implementation level available here.

Levels (``harness.runners.paddle.levels`` picks; ``config.paddle_impl`` pins one): 1. PaddleFleet with the case's
``use_accuracy_compatible`` (``fleet.py``; GPU, where ``paddlefleet`` imports); 2. PaddleFormers' module
(``formers.py``; DeepseekV3 and its shared modules, non-fused where the fused kernel does not exist on the device);
3. the reference recipe, plain Paddle ops computing what the PaddleFleet code it cites computes, not PaddleFleet
(``recipe.py``); pinned only, its FP32-island variant (``islands.py``). ``meta.json`` records the level that ran,
why each higher one was passed over, what the level follows or calls (``paddle_source``) and the implementation
(prefixed with the level's label, which the report shows); a verdict is only about that implementation.
``python -m harness.runners.paddle --probe --device cpu|gpu`` answers, computing nothing, what would run here
(``python -m harness doctor`` asks it).
- GPU: dygraph on a CUDA build of paddle (paddlepaddle-gpu >= 3.3) that sees a GPU, else UNSUPPORTED saying which.
  TF32 is kept off with ``NVIDIA_TF32_OVERRIDE=0`` (read by cuBLAS itself); ``FLAGS_use_accuracy_compatible_kernel=1``
  comes from the harness (orchestrate.GPU_ENV).
- CPU, bf16: Paddle's dygraph has no CPU bf16 matmul kernel; the recipe builds its linears in a static Program run by
  oneDNN (needs AVX-512; without it UNSUPPORTED, with the kernel and the CPU's ISA named). PaddleFormers' level is
  unavailable where a kernel its module needs is missing in the case's dtype (``paddle_kernels``).
- CPU, fp32: dygraph.
Outputs go back to canonical names and Megatron's ``[out, in]`` weight layout (a transpose: exact).

Tensor parallel (started by ``paddle.distributed.launch``): PaddleFleet's layers on its model-parallel group at the
PaddleFleet level; otherwise each rank runs the recipe on its split weights (partition dims from
``harness.case.ops``) and the partial sums are all-reduced as Megatron does: column-parallel, the input grad;
row-parallel, the output. The plain path has no sequence parallel and no row-parallel bias (said UNSUPPORTED).
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext

import numpy as np

from harness.case.ops import OPS
from harness.run.protocol import (
    OUTPUTS,
    Phases,
    Unsupported,
    import_answer,
    import_failure,
    rank_and_world,
    rank_file_name,
    serve,
    shard_index,
)
from harness.runners.paddle import levels as paddle_levels
from harness.runners.paddle.guard import kernel_guard

try:
    import paddle
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (run, probe)
    paddle = None
    PADDLE_IMPORT_ERROR = error


def run(request: dict, phases: Phases) -> dict:
    if paddle is None:
        raise import_failure("paddle", PADDLE_IMPORT_ERROR) from PADDLE_IMPORT_ERROR
    gate = request["config"]["use_accuracy_compatible"]
    with phases("setup"):
        device = _select_device(request["device"])
        from harness.runners.paddle.common import load_checkpoint

        rank, world = rank_and_world()
        partition = OPS[request["op"]].partition(request["config"])
        tensors = {k: np.ascontiguousarray(v[shard_index(v.shape, partition.get(k), rank, world)])
                   for k, v in load_checkpoint(request["checkpoint"]).items()}  # bf16 as uint16 bits
    with phases("choose_level"):
        choice = paddle_levels.choose(request)  # UNSUPPORTED when the pinned level, or every level, is unavailable
    own_tp = choice.level == "paddlefleet"  # PaddleFleet's layers run on fleet's model-parallel group themselves
    if world > 1 and not own_tp:
        _check_plain_tp(request)
        paddle.distributed.init_parallel_env()
    outputs, implementation = choice.implementation(request, tensors, gate, phases, kernel_guard)
    if world > 1 and not own_tp:
        with phases("all_reduce"):
            implementation += _all_reduce_partials(outputs, request, world)
    with phases("write"):
        _write(outputs, request, rank_file_name(OUTPUTS, rank, world))
    if world > 1 and not own_tp:
        # Every rank done before any leaves: rank 0 hosts the TCP store that rank 1 still uses until it is done. (Rank
        # 0 still aborted in Paddle's interpreter teardown now and then: every runner process now skips that
        # teardown once its files are written, harness.run.protocol.serve.)
        paddle.distributed.barrier()
    level = paddle_levels.import_level(choice.level)
    source = {"paddle_source": level.source(request)} if hasattr(level, "source") else {}
    return {"framework": "paddle", "implementation": f"[{paddle_levels.LABELS[choice.level]}] {implementation}",
            "tensor_parallel": world, **choice.meta(), **source,
            "versions": {"paddlepaddle": paddle.__version__, "paddle_commit": paddle.version.commit,
                         **getattr(level, "versions", dict)()},
            "paddlefleet_importable": importlib.util.find_spec("paddlefleet") is not None,
            "use_accuracy_compatible": gate, **_device_provenance(device),
            **({"tf32": f"NVIDIA_TF32_OVERRIDE={os.environ['NVIDIA_TF32_OVERRIDE']}"} if device == "gpu" else {})}


def probe(device: str) -> dict:
    """What this environment would run, computing nothing: versions, device, kernels, and per op and dtype the level
    that would run with each level's reason (``python -m harness.runners.paddle --probe``; the doctor asks it)."""
    if paddle is None:
        return {"framework": "paddle", **import_answer("paddle", PADDLE_IMPORT_ERROR)}
    answer = {"framework": "paddle", "importable": True, "versions": {"paddlepaddle": paddle.__version__,
                                                                      "paddle_commit": paddle.version.commit},
              "compiled_with_cuda": paddle.is_compiled_with_cuda()}
    try:
        _select_device(device)
    except Unsupported as reason:
        answer["device_problem"] = str(reason)
    else:
        answer.update(_device_provenance(device))
        from harness.runners.paddle import kernels as paddle_kernels

        answer["kernels"] = paddle_kernels.table(device)
    for level in paddle_levels.LEVELS:
        try:
            answer["versions"].update(getattr(paddle_levels.import_level(level), "versions", dict)())
        except Exception as error:  # noqa: BLE001 - reported per op below as the level's reason
            answer.setdefault("level_import_errors", {})[level] = repr(error)
    answer["ops"] = {}
    variants = [(name, name, {}) for name in OPS] + [("swiglu+per_token_scale", "swiglu", {"per_token_scale": True})]
    for key, name, config in variants:
        answer["ops"][key] = {dtype: paddle_levels.survey({"op": name, "device": device, "dtype": dtype, "tp": 1,
                                                           "config": OPS[name].resolve(config)})
                              for dtype in ("bfloat16", "float32")}
        if "device_problem" in answer:  # nothing runs on this device, whatever the levels say
            for survey in answer["ops"][key].values():
                survey.update(would_run=None, label=f"UNSUPPORTED: {answer['device_problem']}")
    broken = {s["broken"]: s["levels"][s["broken"]] for by_dtype in answer["ops"].values()
              for s in by_dtype.values() if "broken" in s}
    if broken:  # an installed level that does not import: every request reaching it is an ERROR
        answer.update(broken=True, broken_levels=broken, reason="; ".join(broken.values()))
    return answer


def _check_plain_tp(request):
    if request["config"].get("sequence_parallel", False):  # linears only
        raise Unsupported("sequence_parallel: the plain-Paddle tensor-parallel path has no sequence parallel "
                          "(it comes with PaddleFleet's layers, which are not importable here)")
    if request["op"] == "row_parallel_linear" and request["config"]["bias"]:
        raise Unsupported("row-parallel bias at tp > 1: the plain-Paddle path does not add it after the reduce")


def _all_reduce_partials(outputs, request, world) -> str:
    """Sum the per-rank partial results over the ranks, where Megatron's layers do the same all-reduce."""
    names = OPS[request["op"]].reduced
    for name in names:
        partial = paddle.to_tensor(outputs[name], place=paddle.CPUPlace() if request["device"] == "cpu" else None)
        paddle.distributed.all_reduce(partial)
        outputs[name] = partial.numpy()
    backend = "gloo" if request["device"] == "cpu" else "nccl"
    return f"; TP={world}: split weights, {', '.join(names)} partial sums by paddle.distributed.all_reduce ({backend})"


def _write(outputs, request, file_name):
    from safetensors.paddle import save_file

    dtypes = {"bfloat16": paddle.bfloat16, "float16": paddle.float16, "float32": paddle.float32, "int64": paddle.int64}
    specs = OPS[request["op"]].outputs(request["shapes"], request["tokens"], request["config"])
    expected = {spec.name: dtypes[spec.dtype or request["dtype"]] for spec in specs}
    tensors = {}
    for name, array in outputs.items():
        tensor = paddle.to_tensor(array, place=paddle.CPUPlace())  # uint16 arrays become bf16 tensors
        dtype = expected.get(name, dtypes[request["dtype"]])
        if tensor.dtype != dtype:
            raise RuntimeError(f"output {name!r} came back as {tensor.dtype}, expected {dtype}")
        tensors[name] = tensor
    save_file(tensors, os.path.join(request["output_dir"], file_name))


def _synchronize(request) -> None:
    if request["device"] == "gpu":
        paddle.device.synchronize()


def _select_device(name: str) -> str:
    if name == "gpu":
        if not paddle.is_compiled_with_cuda():
            raise Unsupported(f"paddle {paddle.__version__} at {paddle.__file__} is a CPU build: install a "
                              "paddlepaddle-gpu >= 3.3 build (and PaddleFleet) in the Paddle runner's environment")
        if paddle.device.cuda.device_count() < 1:
            raise Unsupported(f"paddle {paddle.__version__} (CUDA {paddle.version.cuda()}) sees no GPU")
        os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")  # before the first cuBLAS handle exists
        paddle.set_device(f"gpu:{os.environ.get('FLAGS_selected_gpus', '0').split(',')[0]}")  # a launcher's rank
    else:
        paddle.set_device("cpu")
    return name


def _device_provenance(device: str) -> dict:
    info = {"paddle_with_mkl": getattr(paddle.version, "with_mkl", None), "paddle_onednn": _onednn_version()}
    if device == "gpu":
        props = paddle.device.cuda.get_device_properties()
        info.update({"gpu": props.name, "gpu_capability": f"{props.major}.{props.minor}",
                     "cuda_runtime": paddle.version.cuda(), "cudnn": paddle.version.cudnn()})
    return info


def _onednn_version() -> str | None:
    """oneDNN bundled with this Paddle, read from the shared library's file name."""
    libs = os.path.join(os.path.dirname(paddle.__file__), "libs")
    names = sorted(n for n in os.listdir(libs) if n.startswith("libdnnl")) if os.path.isdir(libs) else []
    return names[-1] if names else None


def release() -> None:
    """Between a worker's cells (without paddle, a cell only said UNSUPPORTED)."""
    if paddle is not None:
        from harness.runners.paddle.common import release as paddle_release

        paddle_release()


def cell_state():
    """Around one cell: Paddle's process-wide settings put back when it ends (``harness.runners.paddle.state``)."""
    if paddle is None:
        return nullcontext()
    from harness.runners.paddle import state

    return state.cell_state()


def main() -> None:
    serve("paddle", run, probe, release, cell_state)
