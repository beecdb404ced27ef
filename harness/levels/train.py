"""The training level: N optimizer steps of the whole causal LM in each stack's own training code, every state tensor
after every step (op ``causal_lm_train``, docs/training.md).

Its truth is ``hf_model`` trained in float64 under its own interpreter, its every step held to the optimizer's float64
formula and each side's step to the truth's (``harness.compare.train_truth``); a float64 case is judged at every step
from the same state on both sides (``harness.compare.train_float64``, which needs the re-feed in time, run for it);
``--versus dp=N`` and ``--versus ep=N`` compare one stack with itself on another number of ranks
(docs/training-ranks.md).
"""

from __future__ import annotations

from dataclasses import replace

from harness.case.registry import RUNNERS, Case, CaseError
from harness.case.train_settings import EXPERT_PARALLEL_RUNNERS, parse_steps_kept, with_ranks
from harness.compare import train_float64, train_follow, train_refeed, train_steps, train_truth
from harness.compare.model_outputs import TRUTH_LABEL, TRUTH_RUNNER
from harness.compare.result import ERROR, CaseResult
from harness.levels.base import Level, Run, Versus, same_runner
from harness.levels.float64 import semantic_verdict
from harness.run.orchestrate import SideResult, SideSpec, pair_sides
from harness.run.steps import PACE

RANK_KINDS = {"dp": "data_parallel", "ep": "expert_parallel"}


class TrainLevel(Level):
    name = "train"
    versus_axes = ("dp", "ep")
    truth_runner = TRUTH_RUNNER

    def prepare(self, case: Case, dp: int | None, ep: int | None, steps_kept: str | None) -> Case:
        if steps_kept is not None:
            try:
                kept = parse_steps_kept(steps_kept, case.train.steps)
            except ValueError as error:
                raise CaseError(f"case {case.name!r}: {error}") from None
            case = case.with_train(replace(case.train, steps_kept=tuple(kept)))
        if dp is not None or ep is not None:
            train_ = case.train
            ranked = with_ranks(train_, case.model, train_.dp if dp is None else dp,
                                train_.ep if ep is None else ep, _ranks_error(case, "--dp / --ep"))
            case = case.with_train(ranked)
        return case

    def check(self, case: Case, repeat: int, refeed: bool, versus: Versus | None) -> None:
        if repeat > 1:
            raise CaseError(f"case {case.name!r}: --repeat is not implemented for training cases")
        if refeed and (versus or case.train.dp > 1):
            raise CaseError(f"case {case.name!r}: --refeed re-runs one rank's training (dp = 1): give it without "
                            "--dp or --versus")

    def versus(self, case: Case, versus: Versus) -> tuple[Case, dict]:
        if versus.axis not in self.versus_axes:
            return super().versus(case, versus)
        option = f"--versus {versus.axis}"
        pair = same_runner(case, versus, RUNNERS)
        train_ = case.train
        a = {"dp": train_.dp, "ep": train_.ep}
        b = {**a, versus.axis: versus.b}
        with_ranks(train_, case.model, b["dp"], b["ep"], _ranks_error(case, option))
        if a == b:
            raise CaseError(f"{case.source}: case {case.name!r}: {option}={versus.b} is side a's {versus.axis} already "
                            f"(train.{versus.axis} = {versus.b}); give side a another with --{versus.axis}")
        return pair, {"kind": RANK_KINDS[versus.axis], "runner": pair.runners[0],
                      **{f"{k}_{label}": sizes[k] for label, sizes in zip("ab", (a, b), strict=True)
                         for k in ("dp", "ep")}}

    def ranks(self, case: Case) -> int:
        return case.tp * case.train.dp

    def sides(self, run: Run) -> list[SideSpec]:
        ranked = _ranked(run)
        for runner, sizes in zip(run.case.runners, ranked or ({"dp": run.case.train.dp, "ep": run.case.train.ep},) * 2,
                                 strict=True):
            if sizes["ep"] > 1 and runner not in EXPERT_PARALLEL_RUNNERS:
                raise CaseError(f"{run.case.source}: case {run.case.name!r}: train.ep = {sizes['ep']}: runner "
                                f"{runner!r} has no expert-parallel MoE layer (expert parallel runs on "
                                f"{', '.join(EXPERT_PARALLEL_RUNNERS)})")
        return _pair(run, ranked)

    def truth(self, run: Run) -> SideSpec | None:
        """hf_model's training run in float64 on the shared checkpoint, on one rank (the global batch's exact result
        does not depend on how ranks split it): no masters, no flip. None for a float64 case (its own check)."""
        if run.case.dtype == "float64":
            return None
        train_ = run.case.train
        # each kept step and the one before it: the state a step starts from, for the check of its update
        kept = sorted({*train_.steps_kept, *(k - 1 for k in train_.steps_kept if k > 1)})
        settings = replace(train_, master_weights=False, flip=None, dp=1, ep=1, steps_kept=tuple(kept)).to_dict()
        return SideSpec(TRUTH_LABEL, TRUTH_RUNNER, run.checkpoint.files, 1, f"{TRUTH_LABEL}-{TRUTH_RUNNER}-float64",
                        "float64", {"train": settings, **_pace(run)}, per_step=True, truth=True)

    def follows(self, case: Case, device: str, keep_tensors: bool, versus: Versus | None) -> bool:
        """A night's (no tensors kept) case on a CPU (its runs write at once), one rank a side."""
        return (not keep_tensors and device == "cpu" and versus is None and case.tp == 1 and case.train.dp == 1
                and case.train.ep == 1)

    def follow(self, run: Run, truth: SideSpec | None, refeed: bool) -> None:
        """A night's (``run.keep_tensors`` False) training case on one CPU rank: its steps judged as they are written,
        their tensors given back once no later judgment reads them (harness.compare.train_follow); its re-fed runs,
        if any, run beside the pair (harness.compare.train_refeed.Beside)."""
        if not _follows(run):
            return
        initial = train_truth.initial_state(run.case, run.checkpoint.files) if truth else None
        folders = [SideResult(spec.label, spec.runner, "ok", run.run_dir / spec.folder, "")
                   for spec in [*run.pair, *([truth] if truth else [])]]
        refeeding = (refeed or _float64_refeed(run)) and train_refeed.every_step_kept(run.case)

        def beside(plain: list) -> train_refeed.Beside:  # the re-fed runs, started with the pair
            return train_refeed.Beside(run.case, run.pair, folders[:2], run.device, run.run_dir, run.pythons,
                                       run.timeout, plain)

        run.follower = train_follow.follow(run.case, folders[:2], folders[2] if truth else None, initial,
                                           beside if refeeding else None)

    def compare(self, run: Run, result: CaseResult) -> None:
        """Every step of the pair; with a truth that ran, the truth's own check first: a step where it does not
        follow the optimizer's formula judges no side (neither "closer" counts nor flags)."""
        truth = run.truth if run.truth is not None and run.truth.status == "ok" else None
        if run.follower is not None:
            run.follower.judged_all()
            judge = run.follower.judge
            result.tensors, result.train, checked = judge.results(run.truth)
            if checked is not None:
                result.train["truth"]["check"] = checked
                result.train["truth"]["step_errors"], result.train["farther"] = judge.errors, judge.flags
            return
        checked, initial = None, None
        if truth is not None:
            initial = train_truth.initial_state(run.case, run.checkpoint.files)
            checked = train_truth.check_truth(run.case, truth, initial)
        unreliable = {int(k) for k in (checked or {}).get("unreliable", {})}
        result.tensors, result.train = train_steps.compare_steps(run.case, run.framework, run.truth, unreliable)
        if checked is not None:
            result.train["truth"]["check"] = checked
            errors, flags = train_truth.farther(run.case, run.framework, truth, initial, unreliable)
            result.train["truth"]["step_errors"], result.train["farther"] = errors, flags
        if run.versus:  # which quantities stay bitwise, from which step each parts
            result.comparison.update(train_steps.invariance(result.train))

    def refeed(self, run: Run, result: CaseResult, asked: bool) -> None:
        """Side b re-run from side a's state, step by step: asked, or for a float64 case's check of every step."""
        beside = run.follower.judge.beside if run.follower is not None else None
        if beside is not None:  # run beside the pair (a night's case on a CPU)
            result.train["refeed"], run.refed = beside.results(result.tensors)
        elif asked or _float64_refeed(run):
            result.train["refeed"], run.refed = train_refeed.run(run.case, run.checkpoint, run.pair, run.framework,
                                                                 result.tensors, run.device, run.run_dir,
                                                                 run.pythons, run.timeout, run.keep_tensors)

    def judge(self, run: Run, result: CaseResult) -> None:
        """A float64 case: every step judged (harness.compare.train_float64); a re-feed that failed or did not
        reproduce side b's own steps leaves the check unjudged past step 1: ERROR, saying so. Any other case: a truth
        that does not follow the optimizer's formula at a step is ERROR (its distances are no evidence there)."""
        unreliable = ((result.train or {}).get("truth") or {}).get("check", {}).get("unreliable")
        if unreliable and result.verdict not in (ERROR, "UNSUPPORTED"):
            first = min(unreliable, key=int)
            result.verdict = ERROR
            result.message = (f"the float64 truth is unreliable at step{'s' if len(unreliable) > 1 else ''} "
                              f"{', '.join(sorted(unreliable, key=int))}: {unreliable[first]}; no side is judged "
                              f"against it there (its python: {run.truth.python}); {result.message}")
        if run.case.dtype != "float64" or not result.tensors:
            return
        refeed = result.train.get("refeed") or {}
        if _float64_refeed(run) and refeed.get("status") != "ok" and result.verdict in ("DIFF", "BITWISE_PASS"):
            result.verdict = ERROR
            result.message = (f"float64 check of every step could not judge steps 2 on: re-feed "
                              f"{refeed.get('status')}: {refeed.get('reason')}")
            return
        semantic_verdict(result, train_float64.check(run.case, result.tensors, run.refed), result.train)

    def unexpected(self, run: Run, result: CaseResult) -> list[str]:
        """A side farther from the truth at a step than ``train_truth.FARTHER`` allows: never an expectation met."""
        return [f"side {f['side']} ({f['runner']}) farther from the float64 truth than expected at step {f['step']} "
                f"in {f['quantity']} (its step off by {f['error']:.3g} of the truth's, allowed "
                f"{train_truth.FARTHER:g})" for f in (result.train or {}).get("farther", [])]

    def notes(self, run: Run, result: CaseResult) -> list[str]:
        notes = self.unexpected(run, result)
        c = result.comparison
        if c and result.tensors:
            kind = "dp" if c["kind"] == "data_parallel" else "ep"
            departs = ", ".join(f"{q} at step {k}" for q, k in c["departs"].items())
            notes.append(f"{c['runner']} {kind.upper()}={c[kind + '_a']} vs {kind.upper()}={c[kind + '_b']}: "
                         f"bitwise at every step: {', '.join(c['bitwise']) or 'none'}; departs: {departs or 'none'}")
        refeed = result.train.get("refeed") or {}
        if refeed.get("status") == "unfaithful":
            notes.append(f"re-feed in time not faithful ({refeed['reason']}): its attribution is not evidence")
        return notes


def _pair(run: Run, ranked: tuple[dict, dict] | None) -> list[SideSpec]:
    """The pair; a planted flip (``train.flip``) goes into its own side's request only; comparing rank counts
    (`ranked`: side a's and side b's {"dp", "ep"}), each side at its own, its folder named by them."""
    case = run.case
    flip = case.train.flip
    out = []
    for side, sizes in zip(pair_sides(case, run.checkpoint), ranked or (None, None), strict=True):
        settings = replace(case.train, **(sizes or {}), flip=flip if flip and flip.side == side.label else None)
        if settings.flip and (settings.flip.rank or 0) >= settings.dp:  # --dp / --versus: fewer
            raise CaseError(f"{case.source}: case {case.name!r}: train.flip.rank must be a data-parallel rank of side "
                            f"{side.label}, which trains on dp = {settings.dp} (got {settings.flip.rank})")
        folder = side.folder + (f"-dp{sizes['dp']}-ep{sizes['ep']}" if sizes else "")
        out.append(side._replace(folder=folder, config={"train": settings.to_dict(), **_pace(run)}, dp=settings.dp,
                                 per_step=True))
    return out


def _ranked(run: Run) -> tuple[dict, dict] | None:
    """Comparing rank counts: side a's and side b's {"dp", "ep"}."""
    if run.versus is None:
        return None
    a = {"dp": run.case.train.dp, "ep": run.case.train.ep}
    return a, {**a, run.versus.axis: run.versus.b}


def _follows(run: Run) -> bool:
    return LEVEL.follows(run.case, run.device, run.keep_tensors, run.versus)


def _pace(run: Run) -> dict:
    """A followed run's config entry that paces it (harness.run.steps.PACE)."""
    return {PACE: True} if _follows(run) else {}


def _float64_refeed(run: Run) -> bool:
    """Whether a float64 training case's check gets its re-fed runs (they train one rank)."""
    return run.case.dtype == "float64" and run.versus is None and run.case.train.dp == 1


def _ranks_error(case: Case, option: str):
    return lambda field, problem, value: CaseError(f"{case.source}: case {case.name!r}: {option}: train.{field} "
                                                   f"{problem} (got {value!r})")


LEVEL = TrainLevel()
