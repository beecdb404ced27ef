"""Training runs followed as they write their step files (``harness.run.steps``: a step file appears whole; a followed
run is paced), so the harness judges each step as soon as every run has it and the runs never get more than a step
ahead of the judging (issue 47: a night's peak of disk). What judging a step means is the caller's
(``harness.compare.train_follow``, ``harness.compare.train_refeed``).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from harness import resources
from harness.run import steps

POLL_SECONDS = 0.1


class Follower(threading.Thread):
    """Judges step 1, 2, ... of the runs in `folders` ({label: folder}) as soon as each is there (`judge.step(k,
    labels present)`), then lets them write on. `required`: the labels without which nothing more is judged.
    `beside`: runs started beside these that read their steps (``harness.compare.train_refeed.Beside``): released
    with them, and ``finish`` waits for them."""

    def __init__(self, folders: dict[str, Path], required: set[str], count: int, judge, beside=None):
        super().__init__(name="train-follow", daemon=True)
        self.folders, self.required, self.count, self.judge = dict(folders), set(required), count, judge
        self.beside = beside
        self.judged, self.abandoned, self.error = 0, False, None
        self.waiting, self.writing = [], None  # the runs not yet let write their next step; the last one let
        self._stop_event = threading.Event()

    def run(self) -> None:
        try:
            while self.judged < self.count and not self.abandoned:
                stopping = self._stop_event.is_set()  # the runs have ended: what is there is all there is
                self._let_write()
                if self._advance(stopping):
                    continue
                if stopping:
                    break
                time.sleep(POLL_SECONDS)
            self._release()
            if self.abandoned:
                self._discard()
        except BaseException as error:  # kept for finish(): the comparison ends ERROR saying why
            self.error = error
        finally:
            self._release()

    def _discard(self) -> None:
        """A required run ended early, so nothing will be compared: the others' steps are given back as they land,
        until they end (a night's case whose side b is UNSUPPORTED here held side a's and the truth's every step)."""
        while self.folders:
            stopping = self._stop_event.is_set()
            for label, folder in list(self.folders.items()):
                ended = stopping or (folder / steps.STEPS_DIR / steps.ENDED).exists()  # first, as in _advance
                for path in sorted((folder / steps.STEPS_DIR).glob("step*.safetensors")):
                    if not path.name.endswith(steps.PARTIAL_SUFFIX):
                        steps.give_back(path)
                if ended:
                    del self.folders[label]
            time.sleep(0 if stopping else POLL_SECONDS)

    def _advance(self, stopping: bool) -> bool:
        """Judge the next step if every run still followed has written it; whether it did."""
        step = self.judged + 1
        for label, folder in list(self.folders.items()):
            ended = stopping or (folder / steps.STEPS_DIR / steps.ENDED).exists()  # first: then the files are final
            if not steps.step_file(folder, step).exists():
                if not ended:
                    return False
                del self.folders[label]
                if label in self.required:
                    self.abandoned = True
                    return False
        self.judge.step(step, set(self.folders))
        resources.give_back_freed_memory()  # what judging the step read (a MiniMax-M2 float64 step: 0.95 GB a run)
        self.judged = step
        self.waiting, self.writing = list(self.folders.values()), None
        self._let_write()
        return True

    def _let_write(self) -> None:
        """Let the runs write their next step one after another, each once the one before has written it (or ended):
        a step file takes its whole size until it is written and its zero blocks go, so writes that overlap add up."""
        step = self.judged + 1
        while self.waiting:
            last = self.writing
            if last is not None and not (steps.step_file(last, step).exists()
                                         or (last / steps.STEPS_DIR / steps.ENDED).exists()):
                return
            self.writing = self.waiting.pop(0)
            steps.mark(self.writing, steps.consumed_marker(self.writing, self.judged).name)

    def _release(self) -> None:
        for folder in self.folders.values():
            if not (folder / steps.STEPS_DIR / steps.RELEASED).exists():
                steps.mark(folder, steps.RELEASED)
        if self.beside is not None:
            self.beside.release()

    def finish(self, raise_error: bool = True) -> None:
        """Once the runs have ended: judge what is left, then end; re-raise what went wrong in the thread."""
        self._stop_event.set()
        self.join()
        if self.beside is not None:
            self.beside.join()
        if self.error is not None and raise_error:
            raise self.error

    def judged_all(self) -> None:
        """Raise unless every step was judged (a comparison that reads the judge's records needs them all)."""
        if self.judged != self.count or self.abandoned:
            raise RuntimeError(f"following the training runs judged {self.judged} of {self.count} steps, though every "
                               "run ended ok: nothing compares the steps given back")
