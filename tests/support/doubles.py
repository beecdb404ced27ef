"""Test doubles, named as such: stand-ins for broken runners and interpreters, to test the harness's own
handling of failures. They never produce a reported verdict of a real comparison."""

from __future__ import annotations

import stat
import sys
import textwrap
import time


def fake_interpreter(folder, name, body) -> str:
    """An executable script at `folder`/`name` used as a runner's interpreter (``--python RUNNER=PATH``)."""
    path = folder / name
    path.write_text(textwrap.dedent(body))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def alive(pid, wait=5.0) -> bool:
    """True if `pid` still runs after `wait` seconds (a zombie awaiting its reaper counts as dead)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.1)
    return True


def python_with(folder, name, packages: dict[str, str]) -> str:
    """An interpreter (this one) with a folder of `packages` ({package: its ``__init__.py`` text}) first on its path:
    a package there shadows the installed one (a broken install, when its text fails to import)."""
    site = folder / f"{name}_site"
    for package, text in packages.items():
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text(text)
    return fake_interpreter(folder, name, f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')


def broken_install_python(folder, package: str) -> str:
    """Test double: this interpreter with `package` installed but broken (a dependency missing inside it: a
    ModuleNotFoundError for another name), the way a partial or mismatched install fails."""
    return python_with(folder, f"broken_{package}_python",
                       {package: f"import {package}_test_double_missing_dependency\n"})


def missing_package_python(folder, package: str) -> str:
    """Test double: this interpreter in which `package` is not installed (a finder first on ``sys.meta_path``, put
    there by a ``sitecustomize`` module, answers ModuleNotFoundError for it, as Python does for a package it cannot
    find)."""
    hide = textwrap.dedent(f"""\
        import sys


        class HideForTest:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == {package!r}:
                    raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by a test double)", name=name)
                return None


        sys.meta_path.insert(0, HideForTest())
        """)
    site = folder / f"no_{package}_site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(hide)
    return fake_interpreter(folder, f"no_{package}_python",
                            f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')


def python_with_startup(folder, name, code: str) -> str:
    """An interpreter (this one) that runs `code` at startup, as ``sitecustomize``, before the runner: a fault planted
    in a real stack (its library patched in that process only), so a test can see the harness catch it."""
    site = folder / f"{name}_site"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    return fake_interpreter(folder, name, f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec "{sys.executable}" "$@"\n')


def ends_before_step(folder_name: str, step: int, pids) -> str:
    """Startup code (``python_with_startup``) for a training run that fails as it writes its step `step` (`step` > 1;
    a followed run once the harness took its step before): the run whose folder is `folder_name` (``b-hf_model``,
    ``b-hf_model-refeed-state``) raises there, the way a crashing stack ends a run part way; every run started with
    it writes its pid into the folder `pids` (so a test can see each process gone)."""
    return f"""
        import os
        import pathlib

        from harness.run import steps

        pathlib.Path({str(pids)!r}, str(os.getpid())).touch()
        original = steps.StepWriter.write
        def write(self, step, *args, **kwargs):
            if self.folder.name == {folder_name!r} and step == {step}:
                if self.paced:  # once the harness has taken the step before (a followed run's)
                    steps.wait_consumed(self.folder, step - 1)
                raise RuntimeError("test double: a planted fault ends this run as it writes step {step}")
            return original(self, step, *args, **kwargs)
        steps.StepWriter.write = write
    """


def ten_x_lr_at_step(step: int) -> str:
    """Startup code (``python_with_startup``) for a fault in torch's AdamW: its `step`-th call uses 10x the lr, the lr
    the runner reads before step() unchanged."""
    return f"""
        import torch
        original, calls = torch.optim.AdamW.step, [0]
        def step(self, *args, **kwargs):
            calls[0] += 1
            if calls[0] != {step}:
                return original(self, *args, **kwargs)
            saved = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = 10 * group["lr"]
            try:
                return original(self, *args, **kwargs)
            finally:
                for group, lr in zip(self.param_groups, saved):
                    group["lr"] = lr
        torch.optim.AdamW.step = step
    """
