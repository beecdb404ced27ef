"""Megatron-Core runner: sets up the process group and parallel state, loads this rank's inputs, and runs the
op's implementation from ``megatron_ops.IMPLEMENTATIONS`` (Megatron-Core's own modules, no Transformer Engine).

CPU: gloo process group, eager numerics (``TORCHDYNAMO_DISABLE=1``). GPU: NCCL, with the determinism settings
of real alignment runs (``torch_env``). At TP=1 the layer computes forward ``x @ W.t()``, dgrad ``dy @ W`` and
wgrad ``dy.t() @ x`` (``gradient_accumulation_fusion`` off, so no fp32 ``main_grad``). Inputs arrive in
Megatron's own layout, so nothing is transposed.
Tensor parallel: started by torchrun, one process per rank; each rank reads the full checkpoint, takes
its shard (partition dims from ``harness.case.ops``) and writes its own shard of every output.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # jit_fuser is torch.compile: keep eager numerics

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from harness.case.ops import OPS  # noqa: E402
from harness.run.cell_state import all_restored, attribute_restored, patch  # noqa: E402
from harness.run.protocol import (  # noqa: E402
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
from harness.runners.megatron import ops as megatron_ops
from harness.runners.torch import env as torch_env  # noqa: E402

try:
    from megatron.core import __version__ as megatron_version
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import random as tp_random
except Exception as error:  # noqa: BLE001 - not installed: UNSUPPORTED; installed but broken: ERROR (run, probe)
    MEGATRON_IMPORT_ERROR: Exception | None = error
else:
    MEGATRON_IMPORT_ERROR = None


def run(request: dict, phases: Phases) -> dict:
    if MEGATRON_IMPORT_ERROR is not None:
        raise import_failure("megatron.core", MEGATRON_IMPORT_ERROR) from MEGATRON_IMPORT_ERROR
    rank, world = rank_and_world()
    sequence_parallel = request["config"].get("sequence_parallel", False)  # linears only
    with phases("setup"):
        device = torch_env.select_device(request["device"], int(os.environ.get("LOCAL_RANK", 0)))
        determinism = torch_env.apply_determinism(device)
        init_process_group(device)
        if sequence_parallel and device.type == "cpu":
            patch(torch.cuda, "current_device", lambda: "cpu")  # Megatron allocates gather buffers on the "current" GPU
        dtype = torch_env.DTYPES[request["dtype"]]
        partition = OPS[request["op"]].partition(request["config"])
        tensors = torch_env.load_inputs(request["checkpoint"], device,
                                        take=lambda name, t: t[shard_index(t.shape, partition.get(name), rank, world)])
        config = ModelParallelConfig(
            tensor_model_parallel_size=world, sequence_parallel=sequence_parallel,
            use_cpu_initialization=device.type == "cpu", perform_initialization=False, params_dtype=dtype,
            gradient_accumulation_fusion=False)
    implementation_of = megatron_ops.IMPLEMENTATIONS.get(OPS[request["op"]])
    if implementation_of is None:
        raise Unsupported(f"the Megatron-Core runner has no implementation of op {request['op']!r}")
    megatron_ops.SHIMS.clear()  # this cell's, in meta.json
    outputs, implementation = implementation_of(request, tensors, config, device, phases)
    with phases("write"):
        save_file({k: v.detach().contiguous().cpu() for k, v in outputs.items()},
                  os.path.join(request["output_dir"], rank_file_name(OUTPUTS, rank, world)))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return {"framework": "megatron-core", "versions": {"megatron-core": megatron_version, **te_version()},
            "implementation": implementation, "determinism": determinism, "tensor_parallel": world,
            "sequence_parallel": sequence_parallel, "distributed_backend": "nccl" if device.type == "cuda" else "gloo",
            "shims": megatron_ops.SHIMS,
            **torch_env.provenance(device)}


def init_process_group(device: torch.device, gloo_groups: bool = False) -> None:
    """`gloo_groups`: Megatron's gloo groups on a GPU too (its optimizer asks for the data-parallel one)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group(backend)
    else:  # one rank: an in-process store, so no port to race for (a free port picked then bound was taken by
        # another of 14 cells at once: EADDRINUSE, an ERROR of the harness's making)
        dist.init_process_group(backend, store=dist.HashStore(), world_size=1, rank=0)
    # On a GPU everything runs over NCCL; Megatron's extra gloo groups would only add a TCP rendezvous.
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(),
                                             create_gloo_process_groups=device.type == "cpu" or gloo_groups)


def cell_state():
    """Around one cell: torch's process-wide settings (``torch_env.CELL_STATE``) and Megatron's RNG tracker
    (``initialize_rng_tracker`` replaces its module globals; core attention and the model runner call it per cell)
    put back when the cell ends. Patches (``torch.cuda.current_device``, ``te_general_gemm``) are undone by the
    protocol (``harness.run.cell_state.patch``)."""
    settings = dict(torch_env.CELL_STATE)
    if MEGATRON_IMPORT_ERROR is None:
        settings["Megatron RNG tracker"] = lambda: attribute_restored(tp_random, "_CUDA_RNG_STATE_TRACKER")
        settings["Megatron RNG tracker initialised"] = lambda: attribute_restored(
            tp_random, "_CUDA_RNG_STATE_TRACKER_INITIALIZED")
    return all_restored(settings)


def reset() -> None:
    """Between a worker's cells: a cell that stopped early (UNSUPPORTED) may leave its process group behind."""
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    torch_env.release()


def te_version() -> dict:
    try:
        import transformer_engine  # noqa: F401  (recorded only: this runner never uses it)

        return {"transformer-engine (installed, unused)": transformer_engine.__version__}
    except ImportError:
        return {}


def probe(device: str) -> dict:
    """What would run here (``--probe``): versions, torch's CPU capability or the GPU, and each op's function."""
    from harness.run.protocol import op_table

    answer = {"framework": "megatron-core", "versions": {"torch": torch.__version__},
              "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        answer["gpu"] = torch.cuda.get_device_name(0)
    if MEGATRON_IMPORT_ERROR is not None:
        return {**answer, **import_answer("megatron.core", MEGATRON_IMPORT_ERROR)}
    answer["versions"]["megatron-core"] = megatron_version
    if device == "gpu" and not torch.cuda.is_available():
        answer["device_problem"] = f"torch {torch.__version__} sees no GPU"
    return {**answer, "importable": True, "ops": op_table(megatron_ops.IMPLEMENTATIONS, "megatron")}


def main() -> None:
    serve("megatron", run, probe, reset, cell_state)
