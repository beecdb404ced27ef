"""No state outlives a cell (harness.run.cell_state): a worker's cell writes the bytes a fresh process writes, for
every runner, whatever the worker served before.

For each runner, op level and model level, truth modes included, one worker (``harness.run.workers``) serves a
mixed sequence of cells through the harness's own path (``orchestrate.run_sides``):
1. a bf16 or fp32 cell;
2. a cell in another mode, chosen to change what the runner changes process-wide: float64 where the runner takes
   it (the model runners' float64 truth and semantic check, the torch ops), else another op and dtype (Paddle's
   bf16 linear runs as a static oneDNN graph with ``FLAGS_use_onednn``; Megatron's router patches
   ``torch.cuda.current_device`` and ``te_general_gemm``; its core attention sets the RNG tracker);
3. the first cell again;
4. a negative control: the first cell with one input bit flipped (its bytes must differ from cell 1's, so a worker
   that handed back stale outputs would fail too).
Every cell then runs again in a process of its own; statuses, reasons and output bytes must be equal cell by cell.
Model cases are the 2-layer Kimi-K2 at tiny widths (8 experts): the point is the process, not the size.

On a CPU without AVX-512 Paddle's bf16 linear is UNSUPPORTED (cell 2): the worker must still give cells 3 and 4 a
dygraph process, which the old code did not (the recipe left the process static when the kernel failed); the Paddle
sequence runs once more with oneDNN capped at AVX2 to show it on every CPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from harness.case import checkpoints
from harness.case.registry import CASES_DIR, Registry
from harness.run import orchestrate, workers
from harness.run.orchestrate import SideSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # every runner, cell by cell: docs/contributing.md, "Two tiers"

TOKENS = 8
# The 2-layer Kimi-K2 (layer 0 dense, layer 1 MoE) at tiny widths (the widths of
# tests/support/deepseek_v3_builder.TINY_SHORT_YARN).
TINY = {"family": "deepseek_v3", "num_hidden_layers": 2, "first_k_dense_replace": 1, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "intermediate_size": 96,
        "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "vocab_size": 128, "max_position_embeddings": 256}
TINY_MODELS = """
[tiny]
description = "2-layer Kimi-K2, tiny widths"
op = "causal_lm"
dtype = "float32"
seed = 7
tokens = 8
runners = ["hf_model", "hf_model"]
devices = ["cpu"]
config.model = {model}

[tiny_float64]
base = "tiny"
description = "the semantic check's dtype"
dtype = "float64"

[tiny_float64_dense]
base = "tiny_float64"
description = "both layers dense (PaddleFormers' MoE has no float64 path)"
config.model = { first_k_dense_replace = 2 }

[tiny_control]
base = "tiny"
description = "one bit of layer 0's up_proj flipped on side b"
perturb = { side = "b", tensor = "model.layers.0.mlp.up_proj.weight", index = [3, 5], bit = 22 }
""".replace("{model}", "{ " + ", ".join(f"{key} = {json.dumps(value)}" for key, value in TINY.items()) + " }")


@dataclass(frozen=True)
class Cell:
    case: str
    dtype: str | None = None  # the case in this dtype; a model case's side runs in it on the case's checkpoint, as
    # the float64 truth does (SideSpec.dtype)
    control: bool = False  # the case's flipped bit (side b's checkpoint); else its unperturbed inputs
    shapes: dict | None = None  # smaller shapes than Kimi-K2's
    config: dict | None = None  # config overrides


def model_cell(case: str = "tiny", dtype=None) -> Cell:
    return Cell(case, dtype, control=case == "tiny_control")


def linear(case: str, dtype=None, control=False, **config) -> Cell:
    return Cell(case, dtype, control, {"input_size": 256, "output_size": 128}, config)


ROUTER = {"hidden_size": 256, "num_experts": 16, "topk": 4}
SEQUENCES = {
    "megatron": [Cell("kimi_core_attention_control_megatron"),
                 Cell("kimi_router_control_megatron", "float32", shapes=ROUTER),
                 Cell("kimi_core_attention_control_megatron"),
                 Cell("kimi_core_attention_control_megatron", control=True)],
    "torch": [linear("kimi_shared_fc1_control_torch"), linear("kimi_shared_fc1_control_torch", "float64"),
              linear("kimi_shared_fc1_control_torch"), linear("kimi_shared_fc1_control_torch", control=True)],
    "torch_nn": [linear("kimi_shared_fc1_control_torch_nn"), linear("kimi_shared_fc1_control_torch_nn", "float64"),
                 linear("kimi_shared_fc1_control_torch_nn"),
                 linear("kimi_shared_fc1_control_torch_nn", control=True)],
    "oracle": [linear("kimi_shared_fc1_control_paddle"), linear("kimi_shared_fc1_control_megatron"),
               linear("kimi_shared_fc1_control_paddle"), linear("kimi_shared_fc1_control_paddle", control=True)],
    # fp32 at the PaddleFormers level (dygraph), then bf16 at the recipe level (a static oneDNN graph on a CPU)
    "paddle": [linear("kimi_shared_fc1_control_paddle", paddle_impl="auto"),
               linear("kimi_shared_fc1_control_megatron"),
               linear("kimi_shared_fc1_control_paddle", paddle_impl="auto"),
               linear("kimi_shared_fc1_control_paddle", control=True, paddle_impl="auto")],
    "megatron_model": [model_cell(), model_cell("tiny_float64"), model_cell(), model_cell("tiny_control")],
    # the float64 truth: hf_model in float64 on the fp32 case's checkpoint, as compare runs it beside two sides
    "hf_model": [model_cell(), model_cell(dtype="float64"), model_cell(), model_cell("tiny_control")],
    # PaddleFormers' MoE has no float64 path (paddle_model says UNSUPPORTED): its float64 cell is all dense
    "paddle_model": [model_cell(), model_cell("tiny_float64_dense"), model_cell(), model_cell("tiny_control")],
}


def side(cell: Cell, runner: str, root: Path, number: int) -> tuple:
    """(case, SideSpec) for one cell: the case on `runner` at TOKENS, its checkpoint prepared under `root`."""
    model = cell.case.startswith("tiny")
    if model:
        (root / "cases").mkdir(parents=True, exist_ok=True)
        (root / "cases" / "tiny.toml").write_text(TINY_MODELS)
    case = Registry.load(root / "cases" if model else CASES_DIR).get(cell.case)
    if not model:
        case = replace(case, dtype=cell.dtype or case.dtype, shapes=cell.shapes or case.shapes,
                       config={**case.config, **(cell.config or {})})
    case = replace(case.with_tokens(TOKENS), runners=(runner, runner), perturb=case.perturb if cell.control else None)
    checkpoint = checkpoints.prepare(case, root / "checkpoints")
    label = "b" if cell.control else "a"
    return case, SideSpec(label, runner, checkpoint.files_for(label), 1, f"cell{number}-{runner}",
                          cell.dtype if model else None)


def run_cells(runner: str, root: Path) -> list:
    results = []
    for number, cell in enumerate(SEQUENCES[runner], start=1):
        case, spec = side(cell, runner, root, number)
        results.append(orchestrate.run_sides(case, [spec], "cpu", root / "run", {}, 600)[0])
    return results


# The Paddle sequence once more with oneDNN capped at AVX2 (the CI's AVX2 CPU, here): its bf16 cell is UNSUPPORTED
# (dnnl::error), and the cells after it must still run in dygraph, as a fresh process does.
CASES = [*SEQUENCES, "paddle (oneDNN at AVX2)"]


@pytest.mark.parametrize("name", CASES)
def test_a_worker_writes_the_bytes_of_fresh_processes_cell_by_cell(name, tmp_path, monkeypatch):
    runner = name.split()[0]
    if name != runner:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # the runners' environment is this process's
    with workers.serving(tmp_path / "workers"):
        served = run_cells(runner, tmp_path / "worker")
    with workers.fresh_processes():
        fresh = run_cells(runner, tmp_path / "fresh")
    pids = {s.meta.get("process", {}).get("pid") for s in served}
    assert len(pids) == 1 and all(s.meta["process"]["mode"] == "shared worker" for s in served), \
        [s.meta.get("process") for s in served]
    for number, (in_worker, alone) in enumerate(zip(served, fresh, strict=True), start=1):
        said = in_worker.reason.replace(str(tmp_path / "worker"), str(tmp_path / "fresh"))
        assert (in_worker.status, said) == (alone.status, alone.reason), (number, in_worker.stderr_tail)
        if alone.status == "ok":
            assert in_worker.outputs.read_bytes() == alone.outputs.read_bytes(), f"cell {number} of {runner}"
    assert fresh[0].status == "ok", fresh[0].reason
    assert fresh[3].outputs.read_bytes() != fresh[0].outputs.read_bytes(), "the control must change the outputs"
