"""The model level: a whole causal LM (op ``causal_lm``) forward and backward in each stack, every module output and
parameter gradient in canonical names (docs/model.md).

Its truth is ``hf_model`` in float64 (none for a float64 case: the case is its own check); a float64 case is judged by
the semantic check (a mapping error is ERROR); its re-feed replays side b module by module with side a's inputs
(``harness.compare.model_refeed``). ``--versus batch=M`` runs one model runner on the case's sequence alone (side a)
and on it first in a batch of 1 + M sequences whose others carry no loss (side b, ``harness.case.batch``), and
compares the first sequence's module outputs, logits, loss and every parameter gradient.
"""

from __future__ import annotations

from harness.case import batch
from harness.case.registry import Case, CaseError
from harness.compare import model_outputs, model_refeed
from harness.compare.result import CaseResult
from harness.levels.base import Level, Run, Versus, same_runner
from harness.levels.float64 import semantic_verdict
from harness.run.orchestrate import SideSpec, pair_sides


class ModelLevel(Level):
    name = "model"
    truth_runner = model_outputs.TRUTH_RUNNER
    versus_axes = ("batch",)

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        if versus.axis != "batch":
            return super().versus(case, versus)
        pair = same_runner(case, versus, batch.MODEL_RUNNERS)
        batch.check_model(pair, versus.b)
        return pair, {"kind": "batch", "runner": pair.runners[0], "rows": case.tokens, "others": versus.b,
                      "unit": "sequence"}

    def check(self, case: Case, repeat: int, refeed: bool, versus: Versus | None) -> None:
        if refeed and versus:
            raise CaseError(f"{case.source}: case {case.name!r}: --refeed re-runs side b's modules from side a's "
                            "tensors; with --versus batch the sides hold different batches: leave one out")

    def sides(self, run: Run) -> list[SideSpec]:
        if not run.versus:
            return pair_sides(run.case, run.checkpoint)
        alone, _ = pair_sides(run.case, run.checkpoint)
        inputs = batch.write_sequences(run.case, run.versus.b, run.checkpoint, run.run_dir)
        files = (*run.checkpoint.files[:-1], inputs)  # the shared weights, then the batch's ids and labels
        return [alone, SideSpec("b", run.case.runners[1], files, 1,
                                f"b-{run.case.runners[1]}-batch{1 + run.versus.b}")]

    def truth(self, run: Run) -> SideSpec | None:
        """hf_model in float64 on the shared (unperturbed) checkpoint; None for a float64 case (its own check)."""
        if run.case.dtype == "float64":
            return None
        return SideSpec(model_outputs.TRUTH_LABEL, model_outputs.TRUTH_RUNNER, run.checkpoint.files, 1,
                        f"{model_outputs.TRUTH_LABEL}-{model_outputs.TRUTH_RUNNER}-float64", "float64", truth=True)

    def compare(self, run: Run, result: CaseResult) -> None:
        compared = model_outputs.compare_outputs(run.case, run.framework)
        result.tensors, result.harness["comparator_memory"], skipped = compared
        if result.tensors:
            result.model = model_outputs.summarise(run.case, result.tensors, skipped,
                                                   model_outputs.idle_experts(run.case, run.framework))

    def versus_truth(self, run: Run, result: CaseResult) -> None:
        result.versus_oracle = model_outputs.versus_truth(run.case, run.framework, run.truth)

    def refeed(self, run: Run, result: CaseResult, asked: bool) -> None:
        if asked:  # side a records each module's inputs, side b replays
            result.refeed = model_refeed.run(run.case, run.pair, result.tensors, run.device, run.run_dir, run.pythons,
                                             run.timeout)

    def notes(self, run: Run, result: CaseResult) -> list[str]:
        """Under --versus batch: which tensors keep the sequence's bits inside the batch (also in `comparison`)."""
        c = result.comparison
        if not c or not result.tensors:
            return []
        c["batch_invariant"] = [t.name for t in result.tensors if t.status == "EQUAL"]
        c["not_batch_invariant"] = [t.name for t in result.tensors if t.status != "EQUAL"]
        return [f"{c['runner']}: its {c['rows']}-token sequence alone vs first in a batch with {c['others']} other "
                f"sequences (M={c['others']}, their loss weight zero): {len(c['batch_invariant'])} of "
                f"{len(result.tensors)} tensors bitwise batch-invariant; first not: "
                f"{result.first_divergence or 'none'}"]

    def judge(self, run: Run, result: CaseResult) -> None:
        if run.case.dtype == "float64" and result.tensors:
            check = model_outputs.semantic_check(run.case, result.tensors, run.case.runners)
            semantic_verdict(result, check, result.model)


LEVEL = ModelLevel()
