"""The model level: a whole causal LM (op ``causal_lm``) forward and backward in each stack, every module output and
parameter gradient in canonical names (docs/model.md).

Its truth is ``hf_model`` in float64 (none for a float64 case: the case is its own check); a float64 case is judged by
the semantic check (a mapping error is ERROR); its re-feed replays side b module by module with side a's inputs
(``harness.compare.model_refeed``). ``--versus batch=M`` runs one model runner on the case's sequence alone (side a)
and on it first in a batch of 1 + M sequences whose others carry no loss (side b, ``harness.case.batch``), and
compares the first sequence's module outputs, logits, loss and every parameter gradient; ``--versus pad=P`` the same
with the sequence right-padded by P masked tokens beside one other sequence; ``--versus cache=C`` (HF) its logits and
loss computed C tokens at a time through the model's KV cache.
"""

from __future__ import annotations

from dataclasses import replace

from harness import environments
from harness.case import batch
from harness.case.registry import Case, CaseError
from harness.compare import model_outputs, model_refeed
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.result import CaseResult
from harness.levels.base import Level, Run, Versus, same_runner
from harness.levels.float64 import semantic_verdict
from harness.run.orchestrate import SideSpec, pair_sides


class ModelLevel(Level):
    name = "model"
    truth_runner = model_outputs.TRUTH_RUNNER
    versus_axes = ("batch", "pad", "cache", "environment")

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        if versus.axis not in self.versus_axes:
            return super().versus(case, versus)
        if versus.axis == "environment":
            return self._environment(case, versus)
        runners = {"batch": batch.MODEL_RUNNERS, "pad": batch.PAD_RUNNERS, "cache": batch.CACHE_RUNNERS}
        pair = same_runner(case, versus, runners[versus.axis])
        found = {"kind": versus.axis, "runner": pair.runners[0], "rows": case.tokens, "unit": "sequence"}
        if versus.axis == "batch":
            batch.check_model(pair, versus.b)
            return pair, {**found, "others": versus.b}
        if versus.axis == "pad":
            batch.check_model(pair, 1)
            return pair, {**found, "pad": versus.b}
        batch.check_chunk(pair, versus.b)
        return pair, {**found, "chunk": versus.b}

    def _environment(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        """``--versus environment=NAME``: hf_model against itself, side b in environment NAME (transformers 5.23.0)
        and side a in the family's own (the harness's interpreter for the families already here): did upgrading
        transformers change the bits?"""
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

    def check(self, case: Case, repeat: int, refeed: bool, versus: Versus | None) -> None:
        if refeed and versus and versus.axis != "environment":  # side b replays in its environment: same batch
            raise CaseError(f"{case.source}: case {case.name!r}: --refeed re-runs side b's modules from side a's "
                            f"tensors; with --versus {versus.axis} side b runs another batch or pass: leave one out")

    def sides(self, run: Run) -> list[SideSpec]:
        alone, b = pair_sides(run.case, run.checkpoint)
        versus, runner = run.versus, run.case.runners[1]
        if not versus:
            return [alone, b]
        if versus.axis == "environment":
            return [alone, b._replace(environment=versus.b)]
        if versus.axis == "cache":
            return [alone, b._replace(folder=f"b-{runner}-cache{versus.b}", config={"kv_cache_chunk": versus.b})]
        if versus.axis == "pad":
            inputs, folder = batch.write_padded(run.case, versus.b, run.checkpoint, run.run_dir), f"pad{versus.b}"
        else:
            inputs = batch.write_sequences(run.case, versus.b, run.checkpoint, run.run_dir)
            folder = f"batch{1 + versus.b}"
        files = (*run.checkpoint.files[:-1], inputs)  # the shared weights, then side b's ids, labels (and mask)
        return [alone, SideSpec("b", runner, files, 1, f"b-{runner}-{folder}")]

    def truth(self, run: Run) -> SideSpec | None:
        """hf_model in float64 on the shared (unperturbed) checkpoint; None for a float64 case (its own check)."""
        if run.case.dtype == "float64":
            return None
        return SideSpec(model_outputs.TRUTH_LABEL, model_outputs.TRUTH_RUNNER, run.checkpoint.files, 1,
                        f"{model_outputs.TRUTH_LABEL}-{model_outputs.TRUTH_RUNNER}-float64", "float64", truth=True)

    def compare(self, run: Run, result: CaseResult) -> None:
        if run.versus and run.versus.axis == "cache":  # a forward through the cache: its logits and loss only
            a, b = (Dump(side.outputs, dict.fromkeys(batch.CACHE_OUTPUTS, side.outputs)) for side in run.framework)
            result.tensors, result.harness["comparator_memory"] = compare_dumps(a, b)
            return
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
        """Under --versus: which tensors keep the sequence's bits in side b's batch or pass (also in `comparison`)."""
        c = result.comparison
        if not c or not result.tensors or c["kind"] == "environment":
            return []
        c["batch_invariant"] = [t.name for t in result.tensors if t.status == "EQUAL"]
        c["not_batch_invariant"] = [t.name for t in result.tensors if t.status != "EQUAL"]
        side_b = {"batch": f"first in a batch with {c.get('others')} other sequences (M={c.get('others')}, their "
                           "loss weight zero)",
                  "pad": f"right-padded by {c.get('pad')} masked tokens, first in a batch with one other sequence",
                  "cache": f"its logits computed {c.get('chunk')} tokens at a time through the KV cache"}[c["kind"]]
        return [f"{c['runner']}: its {c['rows']}-token sequence alone vs {side_b}: {len(c['batch_invariant'])} of "
                f"{len(result.tensors)} tensors bitwise equal; first not: {result.first_divergence or 'none'}"]

    def judge(self, run: Run, result: CaseResult) -> None:
        if run.case.dtype == "float64" and result.tensors:
            check = model_outputs.semantic_check(run.case, result.tensors, run.case.runners)
            semantic_verdict(result, check, result.model)


LEVEL = ModelLevel()
