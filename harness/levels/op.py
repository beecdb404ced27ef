"""The op level: one op or multi-op block (a linear, the shared-expert MLP...) run by two frameworks on the same bits.

Its truth is the framework-free oracle (``harness.runners.oracle``); its re-feed runs each stage of a block on side b
from side a's tensors (``harness.compare.refeed``); ``--versus tp=N`` and ``--versus impl=LEVEL`` compare one runner
with itself at another tensor-parallel size or Paddle implementation level; ``--versus batch=M`` runs the case's rows
alone on side a and inside a batch of M more rows on side b (``harness.case.batch``), and compares side b's rows.
"""

from __future__ import annotations

from dataclasses import replace

from safetensors.numpy import save_file

from harness.case import batch
from harness.case.checkpoints import load_tensors
from harness.case.ops import KNOBS
from harness.case.registry import RUNNERS, TP_SIZES, Case, CaseError
from harness.compare import refeed
from harness.compare.dumps import Dump, compare_dumps
from harness.compare.result import ORACLE_LABEL, CaseResult
from harness.compare.versus_oracle import versus_oracle
from harness.levels.base import Level, Run, Versus, same_runner
from harness.run.orchestrate import SideSpec, pair_sides
from harness.run.protocol import OUTPUTS

PADDLE = "paddle"  # the runner whose implementation levels --versus impl compares


class OpLevel(Level):
    name = "op"
    versus_axes = ("tp", "impl", "batch")

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        where = f"{case.source}: case {case.name!r}"
        if versus.axis == "tp":
            if versus.b not in TP_SIZES:
                raise CaseError(f"{where}: --versus tp must be one of {', '.join(map(str, TP_SIZES))} "
                                f"(got {versus.b!r})")
            pair = same_runner(case, versus, RUNNERS)
            # at TP=1 the runners get sequence_parallel off (harness.run.orchestrate), so only TP > 1 splits tokens
            case.check_tp(versus.b, case.tokens, case.config if versus.b > 1 else {})
            return pair, {"kind": "tensor_parallel", "runner": pair.runners[0], "tp_a": case.tp, "tp_b": versus.b}
        if versus.axis == "impl":
            choices = KNOBS["paddle_impl"].choices
            if versus.b not in choices:
                raise CaseError(f"{where}: --versus impl must be one of {', '.join(choices)} (got {versus.b!r})")
            level_a = case.config["paddle_impl"]
            if versus.b == level_a:
                raise CaseError(f"{where}: --versus impl={versus.b} is side a's level already (config.paddle_impl); "
                                "give side a another with --paddle-impl")
            pair = replace(case, runners=(PADDLE, PADDLE), perturb=None)
            return pair, {"kind": "paddle_impl", "runner": PADDLE, "impl_a": level_a, "impl_b": versus.b}
        if versus.axis == "batch":
            pair = same_runner(case, versus, RUNNERS)
            batch.batched(pair, versus.b)
            return pair, {"kind": "batch", "runner": pair.runners[0], "rows": case.tokens, "others": versus.b}
        return super().versus(case, versus)

    def check(self, case: Case, repeat: int, refeed: bool, versus: Versus | None) -> None:
        if refeed and versus and versus.axis == "batch":
            raise CaseError(f"{case.source}: case {case.name!r}: --refeed re-runs side b's ops from side a's tensors; "
                            "with --versus batch the sides hold different rows: leave one out")

    def sides(self, run: Run) -> list[SideSpec]:
        case, versus = run.case, run.versus
        if versus and versus.axis == "batch":
            big = batch.batched(case, versus.b)
            inputs = batch.write_inputs(case, big, run.checkpoint, run.run_dir)
            alone, _ = pair_sides(case, run.checkpoint)
            files = (*run.checkpoint.files[:-1], inputs)  # the shared weights, then the batch's inputs
            return [alone, SideSpec("b", case.runners[1], files, 1, f"b-{case.runners[1]}-batch{big.tokens}",
                                    tokens=big.tokens)]
        tps = (case.tp, versus.b) if versus and versus.axis == "tp" else None
        impls = (case.config["paddle_impl"], versus.b) if versus and versus.axis == "impl" else None
        return pair_sides(case, run.checkpoint, tps, impls)

    def truth(self, run: Run) -> SideSpec | None:
        """The framework-free oracle on the shared, unperturbed inputs."""
        return SideSpec(ORACLE_LABEL, "oracle", run.checkpoint.files, 1, f"{ORACLE_LABEL}-oracle", truth=True)

    def compare(self, run: Run, result: CaseResult) -> None:
        if run.versus and run.versus.axis == "batch":
            run.framework[1] = self._rows(run, run.framework[1])
        a, b = (Dump(side.outputs, {spec.name: side.outputs for spec in run.case.output_specs()})
                for side in run.framework)
        result.tensors, result.harness["comparator_memory"] = compare_dumps(a, b)

    def versus_truth(self, run: Run, result: CaseResult) -> None:
        result.versus_oracle = versus_oracle(run.case, run.framework, run.truth)

    def refeed(self, run: Run, result: CaseResult, asked: bool) -> None:
        if asked:
            result.refeed = refeed.run(run.case, run.checkpoint, run.framework, run.device, run.run_dir, run.pythons,
                                       run.timeout)

    @staticmethod
    def _rows(run: Run, side):
        """Side b cut to the case's rows, in a folder of its own beside it (what compare and the truth read)."""
        big = batch.batched(run.case, run.versus.b)
        folder = side.folder.with_name(side.folder.name + "-rows")
        folder.mkdir()
        save_file(batch.rows_of(run.case, big, load_tensors(side.outputs)), str(folder / OUTPUTS))
        return replace(side, folder=folder)

    def notes(self, run: Run, result: CaseResult) -> list[str]:
        """Comparing one runner with itself: which tensors it keeps bitwise across TP sizes or implementation
        levels (kept in the report's `comparison` too)."""
        c = result.comparison
        if not c or not result.tensors:
            return []
        equal = [t.name for t in result.tensors if t.status == "EQUAL"]
        differ = [t.name for t in result.tensors if t.status != "EQUAL"]
        if c["kind"] == "paddle_impl":
            c["equal"], c["differ"] = equal, differ
            return [f"{c['runner']} at {c['impl_a']} vs {c['impl_b']}: bitwise equal: {', '.join(equal) or 'none'}; "
                    f"differ: {', '.join(differ) or 'none'}"]
        if c["kind"] == "batch":
            c["batch_invariant"], c["not_batch_invariant"] = equal, differ
            return [f"{c['runner']}: {c['rows']} rows alone vs inside a batch with {c['others']} other rows (M="
                    f"{c['others']}): bitwise batch-invariant: {', '.join(equal) or 'none'}; "
                    f"not: {', '.join(differ) or 'none'}"]
        c["tp_invariant"], c["not_tp_invariant"] = equal, differ
        return [f"{c['runner']} TP={c['tp_a']} vs TP={c['tp_b']}: bitwise TP-invariant: {', '.join(equal) or 'none'}; "
                f"not: {', '.join(differ) or 'none'}"]


LEVEL = OpLevel()
