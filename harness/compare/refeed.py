"""Re-feed: run each op of a multi-op block again on side b, fed with side a's tensors.

A block's first diverging tensor says where bits first part, but not whether the op that made it went wrong
or only passed on a difference it was given. Re-feeding answers that: every stage runs alone on side b's
runner with its inputs taken from side a's run (side a's intermediates become side b's inputs, op by op;
the block's own inputs and weights come from side b's checkpoint, so a difference planted there stays). A
tensor that differs in the full run but not when re-fed was carried in; one that differs when re-fed was
made by its own op.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from safetensors.numpy import save_file

from harness.case import checkpoints
from harness.case.ops import OPS, REFEED_STAGE
from harness.case.registry import Case
from harness.compare.tensors import DIFF, EQUAL, compare_tensor
from harness.run import orchestrate


def run(case: Case, checkpoint, sides, device: str, run_dir: Path, pythons: dict[str, str], timeout: float) -> dict:
    stages = case.op_spec.stages(case.shapes, case.config) if case.op_spec.stages else []
    if not stages:
        return {"error": f"op {case.op} is a single op: re-feed applies to multi-op blocks"}
    side_a, side_b = sides
    a_outputs = checkpoints.load_tensors(side_a.outputs)
    available = {**checkpoint.tensors("b"), **a_outputs}
    full = {name: compare_tensor(name, a_outputs.get(name), b) for name, b in
            checkpoints.load_tensors(side_b.outputs).items()}
    report = {"runner": side_b.runner, "fed_from": f"side a ({side_a.runner})", "stages": [], "tensors": {}}
    for stage in stages:
        folder = run_dir / "refeed" / stage.name
        folder.mkdir(parents=True)
        inputs = folder / "inputs.safetensors"
        save_file({name: available[source] for name, source in stage.inputs.items()}, str(inputs))
        # refeed_stage: the runner computes the stage as its implementation of the block does (PaddleFormers' MLP
        # runs the shared expert's fc1 as two GEMMs, gate_proj and up_proj; the linear op alone would run one)
        config = OPS[stage.op].resolve({**stage.config, REFEED_STAGE: f"{case.op}.{stage.name}"})
        stage_case = replace(case, name=f"{case.name}.{stage.name}", op=stage.op, shapes=dict(stage.shapes),
                             config=config, perturb=None, weights_from=None)
        side = orchestrate.run_side("b", side_b.runner, stage_case, (inputs,), device, folder / f"b-{side_b.runner}",
                                    pythons, timeout)
        entry = {"stage": stage.name, "op": stage.op, "status": side.status, "reason": side.reason,
                 "implementation": side.meta.get("implementation", ""), "inputs": dict(stage.inputs), "tensors": []}
        if side.status == "ok":
            produced = checkpoints.load_tensors(side.outputs)
            for name, block_name in stage.outputs.items():
                local = compare_tensor(block_name, a_outputs[block_name], produced[name])
                entry["tensors"].append(local.to_dict())
                report["tensors"][block_name] = attribution(full.get(block_name), local, stage.name)
        report["stages"].append(entry)
    made = [name for name, how in report["tensors"].items() if how.startswith("made")]
    report["first_local_divergence"] = next((name for name in _topological(case) if name in made), None)
    return report


def attribution(full, local, stage: str) -> str:
    if local.status == DIFF:
        return f"made by {stage} (differs when re-fed with side a's inputs)"
    if local.status == EQUAL and full is not None and full.status == DIFF:
        return f"carried in ({stage} re-fed with side a's inputs gives side a's bits)"
    return "equal" if local.status == EQUAL else f"{local.status}: {local.note}"


def _topological(case: Case) -> list[str]:
    return [spec.name for spec in case.output_specs()]

