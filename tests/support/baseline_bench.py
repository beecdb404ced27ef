"""The known-verdicts bench: a tiny registry and two runner test doubles, named as such (``fake_megatron_python``,
``fake_paddle_python``), that compute the linear op exactly in float32 numpy and, for the Paddle double, flip the bits,
say UNSUPPORTED or crash as a control file says. Shared by tests/test_baselines.py and tests/test_nightly_disk.py; it
tests the harness's own logic and never produces a reported verdict of a real comparison."""

import json
import sys

from harness.cli import main
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import fake_interpreter

FAKE_RUNNER = """\
#!{python}
import json, pathlib, sys
import numpy as np
from safetensors.numpy import load_file, save_file
request = json.loads(pathlib.Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
role = {role!r}
plan = json.loads(pathlib.Path({control!r}).read_text()).get(request["case"], {{}})
folder = pathlib.Path(request["output_dir"])
meta = {{"runner": role, "framework": "fake-" + role, "versions": {{"fake-" + role: {version!r}}},
        "env": {{"ONEDNN_MAX_CPU_ISA": "AVX2", "ONEDNN_VERBOSE": "1", "HARNESS_PYTHON_X": "/somewhere/python"}}}}
if role == "paddle" and plan.get("crash"):
    sys.exit("fake paddle runner: planted crash")
if role == "paddle" and plan.get("unsupported"):
    if plan.get("broken"):  # a broken install: the runner cannot even say its versions
        meta = {{"runner": role}}
    (folder / "meta.json").write_text(json.dumps({{**meta, "unsupported": plan["unsupported"]}}))
    sys.exit(3)
inputs = {{k: v for path in request["checkpoint"] for k, v in load_file(path).items()}}
x, w, dy = inputs["input"], inputs["weight"], inputs["grad_output"]
tensors = {{"out": x @ w.T, "grad.input": dy @ w, "grad.weight": dy.T @ x}}
tensors = {{k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}}
if role == "paddle":
    for name, index, bit in plan.get("flips", []):
        tensors[name].view(np.uint32)[tuple(index)] ^= np.uint32(1 << bit)
save_file(tensors, str(folder / "outputs.safetensors"))
(folder / "meta.json").write_text(json.dumps(meta))
"""

# A "platform" difference: three elements of `out` that this fake Paddle computes differently on every night.
PLATFORM_DIFF = [["out", [0, 0], 0], ["out", [1, 2], 1], ["out", [3, 3], 2]]

CASES = (
    tiny_case("known_diff", description="DIFF for a platform reason every night"),
    tiny_case("agrees"),
    tiny_case("control", runners=["megatron", "megatron"],
              perturb={"side": "b", "tensor": "input", "index": [1, 2], "bit": 3},
              expect={"verdict": "DIFF", "differs": ["out", "grad.weight"], "equal": ["grad.input"]}),
)


class Bench:
    """A tiny registry, the two doubles, their control file, and folders for reports and baselines."""

    def __init__(self, root, version="1.0"):
        self.root = root
        self.cases = write_cases(root, *CASES)
        self.control = root / "control.json"
        self.plan({"known_diff": {"flips": PLATFORM_DIFF}})
        self.baselines = root / "baselines"
        self.set_version(version)

    def set_version(self, version):
        self.pythons = [f"{role}={fake_interpreter(self.root, f'fake_{role}_python', self._body(role, version))}"
                        for role in ("megatron", "paddle")]

    def _body(self, role, version):
        return FAKE_RUNNER.format(python=sys.executable, role=role, control=str(self.control), version=version)

    def plan(self, plan):
        self.control.write_text(json.dumps(plan))

    def args(self, cases=None, reports="reports"):
        args = ["--cases", str(cases or self.cases), "nightly", "--reports", str(self.root / reports),
                "--checkpoints", str(self.root / "ck"), "--baselines", str(self.baselines), "--timeout", "60",
                "--fresh-process"]  # the doubles serve one request per process (no --worker)
        for item in self.pythons:
            args += ["--python", item]
        return args

    def night(self, capsys, cases=None, *extra, reports="reports"):
        before = set((self.root / reports).glob("nightly-*"))
        code = main(self.args(cases, reports) + list(extra))
        out = capsys.readouterr().out
        (run_dir,) = set((self.root / reports).glob("nightly-*")) - before
        return code, json.loads((run_dir / "report.json").read_text()), run_dir, out

    def update(self, capsys, night_dir=None, *extra):
        args = ["baseline", "update", "--reports", str(self.root / "reports"), "--baselines", str(self.baselines)]
        code = main(args + (["--from", str(night_dir)] if night_dir else []) + list(extra))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    def recorded(self, capsys):
        """A night recorded as this platform's baseline; returns the file."""
        self.night(capsys)
        assert self.update(capsys)[0] == 0
        (written,) = self.baselines.glob("*.json")
        return written


def by_case(night):
    return {entry["case"]: entry for entry in night["cases"]}
