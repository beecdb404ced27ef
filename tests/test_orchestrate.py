"""Runner failures end as ERROR with a report: crash, hang (whole process group killed), bad output.

The failing "interpreters" here are test doubles, named as such: they stand in for a broken runner
to test the harness's own handling, and never produce a reported verdict of a real comparison.
"""

import json
import os
import time

import pytest

from harness import CompareOptions, compare_case
from tests.support.cases import tiny_case, write_cases
from tests.support.doubles import alive, fake_interpreter


@pytest.fixture
def env(tmp_path):
    write_cases(tmp_path, tiny_case())
    return tmp_path


def run(env, pythons, timeout=60.0):
    return compare_case("tiny", CompareOptions(cases_dir=env / "cases", checkpoints_dir=env / "ck",
                                               reports_dir=env / "reports", pythons=pythons, timeout=timeout))


def test_crashing_runner_is_error_with_its_stderr_tail(env):
    crash = fake_interpreter(env, "fake_crashing_python", """\
        #!/bin/sh
        echo "Traceback: simulated crash in the fake runner" >&2
        exit 7
        """)
    result, run_dir = run(env, {"megatron": crash, "paddle": crash})
    assert result.verdict == "ERROR" and result.exit_code == 2
    assert "exited with code 7" in result.message
    report = json.loads((run_dir / "report.json").read_text())
    assert "simulated crash" in report["sides"][0]["stderr_tail"]
    assert "simulated crash" in (run_dir / "report.md").read_text()


def test_hanging_runner_is_killed_with_its_children(env):
    hang = fake_interpreter(env, "fake_hanging_python", f"""\
        #!/bin/sh
        sleep 300 &
        echo $! >> {env}/children
        echo "fake runner hangs" >&2
        sleep 300
        """)
    started = time.monotonic()
    result, run_dir = run(env, {"megatron": hang, "paddle": hang}, timeout=2.0)
    assert time.monotonic() - started < 60
    assert result.verdict == "ERROR" and "timed out after 2 s" in result.message
    assert "fake runner hangs" in result.sides[0].stderr_tail
    for pid in map(int, (env / "children").read_text().split()):
        assert not alive(pid), f"child {pid} of the hung runner survived the kill"
    assert (run_dir / "report.json").exists()


def test_runner_writing_wrong_shapes_is_bad_output(env):
    bad = fake_interpreter(env, "fake_bad_output_python", """\
        #!/usr/bin/env python3
        import json, sys, pathlib
        import numpy as np
        from safetensors.numpy import save_file
        request = json.loads(pathlib.Path(sys.argv[sys.argv.index("--request") + 1]).read_text())
        out = pathlib.Path(request["output_dir"])
        save_file({"out": np.zeros((1, 1), np.float32)}, str(out / "outputs.safetensors"))
        (out / "meta.json").write_text("{}")
        """.replace("#!/usr/bin/env python3", f"#!{os.sys.executable}"))
    result, _ = run(env, {"megatron": bad, "paddle": bad})
    assert result.verdict == "ERROR" and "bad output" in result.message


def test_missing_interpreter_is_error(env):
    result, _ = run(env, {"megatron": str(env / "no-such-python")})
    assert result.verdict == "ERROR" and "could not start interpreter" in result.message


def test_runs_never_overwrite_each_other(env):
    crash = fake_interpreter(env, "fake_crashing_python", "#!/bin/sh\nexit 1\n")
    _, first = run(env, {"megatron": crash, "paddle": crash})
    _, second = run(env, {"megatron": crash, "paddle": crash})
    assert first != second and (first / "report.json").exists() and (second / "report.json").exists()


@pytest.mark.parametrize("name, cases_text, expected", [
    ("nope", tiny_case(), "unknown case 'nope'"),
    ("tiny", tiny_case(dtype="float8"), "field 'dtype'"),
    ("tiny", tiny_case() + "[broken\n", "malformed TOML"),
    ("tiny", tiny_case(tp=8), "'shapes.output_size': must be divisible by tp=8"),
])
def test_bad_input_ends_with_a_report_and_exit_2(env, name, cases_text, expected):
    (env / "cases" / "tiny.toml").write_text(cases_text)
    result, run_dir = compare_case(name, CompareOptions(cases_dir=env / "cases", checkpoints_dir=env / "ck",
                                   reports_dir=env / "reports"))
    assert result.exit_code == 2 and expected in result.message
    assert expected in json.loads((run_dir / "report.json").read_text())["message"]


def test_corrupted_checkpoint_ends_with_a_report_and_exit_2(env):
    from harness.case import checkpoints
    from harness.case.registry import Registry

    checkpoint = checkpoints.prepare(Registry.load(env / "cases").get("tiny"), env / "ck")
    data = bytearray(checkpoint.path.read_bytes())
    data[-3] ^= 0x10
    checkpoint.path.write_bytes(bytes(data))
    result, run_dir = run(env, {})
    assert result.exit_code == 2 and "changed or corrupted" in result.message
    assert not result.sides  # no runner was started on untrusted inputs
    assert "changed or corrupted" in (run_dir / "report.md").read_text()
