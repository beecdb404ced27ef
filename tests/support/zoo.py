"""The model zoo in the end-to-end tests (tests/test_model_e2e.py, tests/test_train_zoo_e2e.py): the registry's CPU
cases of every family but DeepSeek-V3 (whose model cases the committed baselines pin), chosen by what each case
states, so a new family's cases are run by the existing tests; and what a family's own test file adds to them.

A family's tests/test_<family>.py defines
- ``PLANTED_FLOAT64``: (its float64 case, tensor, index) of a difference planted on side b, which the semantic check
  must call a mapping error naming that tensor's module;
- ``FLOAT64_PAIRS`` (optional): (float64 case, runners, the UNSUPPORTED reason every platform gives or None) of the
  pairs run besides each float64 case's own (model and training level alike);
- ``check_run(case, report, run_dir)`` (optional): what a run of one of its cases shows beyond the case's stated
  expectation and the shared checks (a measured count or first tensor, a control's column, its own module named).
"""

from __future__ import annotations

import importlib

from harness.case.registry import Case, Registry
from harness.families import DEFAULT, FAMILIES

ZOO = [name for name in FAMILIES if name != DEFAULT]


def family_tests(family: str):
    """The family's own test module, tests/test_<family>.py."""
    return importlib.import_module(f"tests.test_{family}")


def zoo_cases(op: str, *, but: tuple[str, ...] = ()) -> list[Case]:
    """The registry's CPU cases of `op` of the zoo's families, those of `but` aside."""
    return [case for case in Registry.load().for_device("cpu") if case.op == op and case.model.family in ZOO
            and case.model.family not in but]


def float64_pairs(cases: list[Case]) -> list[tuple[str, tuple[str, str], str | None]]:
    """(case, runners, UNSUPPORTED reason or None): each float64 case of `cases` with its own runners, then the
    other pairs its family's tests add (``FLOAT64_PAIRS``)."""
    own = [(case.name, case.runners, None) for case in cases if case.dtype == "float64"]
    names = {name for name, _, _ in own}
    return own + [pair for family in ZOO for pair in getattr(family_tests(family), "FLOAT64_PAIRS", ())
                  if pair[0] in names]


def check_run(case: Case, report: dict, run_dir) -> None:
    """The family's own checks on a run of one of its cases (``check_run`` in its test file), if it has any."""
    check = getattr(family_tests(case.model.family), "check_run", None)
    if check is not None:
        check(case, report, run_dir)


def assert_config_refused(tmp_path, family: str, config_type, given: dict, problem: str) -> None:
    """A family's bad model config (`given`) is refused twice, naming `problem`: by its typed config
    (``ModelConfigError``), and in a case file by the registry (``CaseError`` naming the file, case and field)."""
    import pytest

    from harness.case.registry import CaseError
    from harness.families import ModelConfigError
    from tests.support.cases import model_case_table

    with pytest.raises(ModelConfigError, match=problem):
        config_type.resolve(given)
    (tmp_path / "m.toml").write_text(model_case_table({"family": family, **given}, tokens=4))
    with pytest.raises(CaseError, match=f"m.toml: case 'm': field 'config.model'.*{problem}"):
        Registry.load(tmp_path)


def python_json(code: str, *args: str) -> dict:
    """Run `code` in a fresh interpreter from the repository root (one OpenMP thread, no TorchDynamo) and return the
    JSON its last line prints; its stderr tail when it fails."""
    import json
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
