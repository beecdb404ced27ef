"""The model level: a whole causal LM (op ``causal_lm``) forward and backward in each stack, every module output and
parameter gradient in canonical names (docs/model.md).

Its truth is ``hf_model`` in float64 (none for a float64 case: the case is its own check); a float64 case is judged by
the semantic check (a mapping error is ERROR); its re-feed replays side b module by module with side a's inputs
(``harness.compare.model_refeed``).
"""

from __future__ import annotations

from dataclasses import replace

from harness import environments
from harness.case.registry import Case, CaseError
from harness.compare import model_outputs, model_refeed
from harness.compare.result import CaseResult
from harness.levels.base import Level, Run, Versus, same_runner
from harness.levels.float64 import semantic_verdict
from harness.run.orchestrate import SideSpec, pair_sides


class ModelLevel(Level):
    name = "model"
    truth_runner = model_outputs.TRUTH_RUNNER
    versus_axes = ("environment",)

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        """``--versus environment=NAME``: hf_model against itself, side b in environment NAME (transformers 5.23.0)
        and side a in the family's own (the harness's interpreter for the families already here): did upgrading
        transformers change the bits?"""
        if versus.axis not in self.versus_axes:
            return super().versus(case, versus)
        where = f"{case.source}: case {case.name!r}"
        try:
            environments.check(versus.b, f"{where}: --versus")
        except ValueError as error:
            raise CaseError(str(error)) from None
        own = environments.of_family(case.model.record)
        if versus.b == own:
            raise CaseError(f"{where}: --versus environment={versus.b} is side a's already (the family's hf.toml)")
        pair = same_runner(case, replace(versus, runner=versus.runner or model_outputs.TRUTH_RUNNER),
                           (model_outputs.TRUTH_RUNNER,))
        return pair, {"kind": "environment", "runner": pair.runners[0], "environment_a": own,
                      "environment_b": versus.b}

    def sides(self, run: Run) -> list[SideSpec]:
        a, b = pair_sides(run.case, run.checkpoint)
        if run.versus and run.versus.axis == "environment":
            b = b._replace(environment=run.versus.b)
        return [a, b]

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

    def judge(self, run: Run, result: CaseResult) -> None:
        if run.case.dtype == "float64" and result.tensors:
            check = model_outputs.semantic_check(run.case, result.tensors, run.case.runners)
            semantic_verdict(result, check, result.model)


LEVEL = ModelLevel()
