"""A night's training case judged step by step as its runs write (issue 47: a training case held every step file of
both sides and of its truth or re-fed run at once, since it was compared only after the runners ended; its peak was
the case's whole run).

A ``Follower`` thread (``harness.run.follow``) watches the runs' step files (``harness.run.steps``: a step file
appears whole) and, once every run it follows has written step k, judges step k with the functions the comparison
after the runs uses (the same records, in the same order), then gives back its tensors (``steps.give_back``) and lets
the runs write step k + 1 (they are paced: ``steps.PACE``). What step k + 1's check of the truth and distances from it
read of step k (its state, not its gradients) is held in memory (``train_truth.held_states``). So a run's folder holds
one step's tensors at a time, the one being written, besides the pair's first divergence.

- ``PairJudge``: the pair and the float64 truth. Once step k is judged it gives back step k of every run, except the
  pair's step of the first divergence (a failing case keeps it: ``harness.commands.nightly_keep``; the truth's goes).
  With a re-feed in time (a float64 case's check of every step), its re-fed runs run beside the pair
  (``train_refeed.Beside``): they take side a's step k once the pair's is judged, and side a's step k goes once they
  have read it, side b's once the re-feed's own check has compared it (``train_refeed.checked_steps``). Of the
  truth's parts, only those of a truth that ended ``ok`` are used, as before.

A run that ends before it writes a step: the truth is followed no further; a side of the pair ends the following
(every run is released: ``steps.RELEASED``, the re-fed runs too), and the case is not compared anyway; a re-fed run
that ends early is followed no further (the re-feed's record says it failed).
"""

from __future__ import annotations

from harness.case.registry import Case
from harness.compare import train_steps, train_truth
from harness.compare.tensors import EQUAL
from harness.run import steps
from harness.run.follow import Follower
from harness.run.orchestrate import SideResult


def follow(case: Case, pair: list[SideResult], truth: SideResult | None, initial, refeed=None) -> Follower:
    """A started follower of the pair and the truth (`truth` None: none runs); `initial`: the checkpoint's state
    (``train_truth.initial_state``), read only with a truth; `refeed(plain)`: the re-fed runs started beside the
    pair (``train_refeed.Beside``), `plain` the pair's comparisons as they are made."""
    judge = PairJudge(case, pair, truth, initial)
    judge.beside = refeed(judge.rows) if refeed else None
    runs = [*pair, *([truth] if truth else [])]
    follower = Follower({run.label: run.folder for run in runs}, {run.label for run in pair}, case.train.steps, judge,
                        judge.beside)
    follower.start()
    return follower


class PairJudge:
    """The pair's and the truth's step k (module docstring); `beside`: the re-fed runs beside the pair, if any."""

    def __init__(self, case: Case, pair: list[SideResult], truth: SideResult | None, initial):
        self.case, self.pair, self.truth, self.initial, self.beside = case, pair, truth, initial, None
        self.rows, self.summaries, self.first = [], [], None
        self.check = train_truth.truth_check(case)
        self.versus, self.errors, self.flags = {}, {}, []
        self.held, self.held_step = {}, None  # {label: the state after step held_step, in memory}

    def step(self, step: int, present: set[str]) -> None:
        rows, summary = train_steps.compare_one_step(self.case, step, self.pair)
        self.rows += rows
        self.summaries.append(summary)
        if self.first is None and any(row.status != EQUAL for row in rows):
            self.first = step
        truth = self.truth if self.truth is not None and self.truth.label in present else None
        if truth is not None:
            train_truth.check_truth_step(self.case, truth, self.initial, step, self.check, self._states)
            if str(step) not in self.check["unreliable"]:
                self.versus[step] = train_steps.versus_truth(self.case, step, self.pair, truth)
                train_truth.farther_step(self.case, self.pair, truth, self.initial, step, self.errors, self.flags,
                                         self._states)
            if step < self.case.train.steps:  # what step + 1's checks read of this step, before it is given back
                self.held = {run.label: train_truth.held_states(run, step, self.initial) for run in (*self.pair, truth)}
                self.held_step = step
        self._give_back(step, truth)

    def _states(self, run: SideResult, step: int, initial):
        if step == self.held_step and step > 0:
            return self.held[run.label]
        return train_truth._states(run, step, initial)

    def _give_back(self, step: int, truth: SideResult | None) -> None:
        """Step `step`'s tensors, judged: the truth's always (a failing case keeps the pair's first divergence, not
        the truth's); the pair's unless it is the first divergence, side b's once the re-fed runs beside the pair
        have read it where their check does, side a's once they have read it."""
        now = [truth] if truth is not None else []
        later = self.pair if step != self.first else []
        if self.beside is None or not self.beside.reads(step):
            now, later = now + later[1:], later[:1]
        for run in now:
            steps.give_back(steps.step_file(run.folder, step))
        if self.beside is not None:
            self.beside.step(step)
        for run in later:
            steps.give_back(steps.step_file(run.folder, step))

    def results(self, truth: SideResult | None) -> tuple[list, dict, dict | None]:
        """(every comparison, the summary along time, the truth's own check or None), `truth` the truth as it ended:
        its parts only of a truth that ended ok, as the comparison after the runs gives them."""
        truth_ok = truth is not None and truth.status == "ok"
        summaries = [{**summary, "truth": self.versus[summary["step"]]} if truth_ok and summary["step"] in self.versus
                     else summary for summary in self.summaries]
        train = train_steps.summarise(self.case, summaries, truth)
        return self.rows, train, self.check if truth_ok else None
