"""make bench's table: every ratio is read from the part of a tree's results that measured it (harness.commands.
bench_speed). The measurements themselves run the real frameworks for minutes: `make bench`, not here."""

from harness.commands import bench_speed


def test_each_ratio_comes_from_its_own_measurement_and_a_skipped_one_is_absent():
    tree = {"rounds": [{"compare / floor": 0.9, "cpu: compare / floor": 1.1}, {"compare / floor": 0.7}],
            "sweep": {"sweep cell / framework work": 2.0},
            "model": {"model: compare / floor": 1.3},
            "train": {"train: compare / bare floor": 1.25, "train: a: dumps: steps / bare steps": 1.1}}
    assert bench_speed._ratio(tree, "compare / floor") == [0.9, 0.7]
    assert bench_speed._ratio(tree, "sweep cell / framework work") == [2.0]
    assert bench_speed._ratio(tree, "model: compare / floor") == [1.3]
    assert bench_speed._ratio(tree, "train: compare / bare floor") == [1.25]
    assert bench_speed._ratio(tree, "train: a: dumps: steps / bare steps") == [1.1]
    assert bench_speed._ratio(tree, "train: b: dumps: steps / bare steps") == []
    assert bench_speed._ratio(tree, "sweep cell / framework work, oracle on") == []
    skipped = {"rounds": []}
    assert all(bench_speed._ratio(skipped, ratio) == [] for ratio in bench_speed.GOALS)
    assert set(bench_speed.GOALS) >= {"compare / floor", "oracle / slower side", "sweep cell / framework work",
                                      "model: compare / floor", "train: compare / bare floor"}


def test_a_tree_inside_a_checkout_is_not_given_the_checkouts_commit(tmp_path):
    """`--before DIR` with an archive unpacked inside this checkout printed this checkout's commit for both trees."""
    import subprocess

    from harness.commands.bench_speed import _commit

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("x")
    git("add", "f")
    git("commit", "-q", "-m", "one")
    inside = tmp_path / "before"
    inside.mkdir()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert _commit(tmp_path) == head.stdout.strip() != ""
    assert _commit(inside) == "not a git checkout"


def test_a_catalogue_error_keeps_its_message_and_the_failed_sides_stderr():
    """The catalogue's reports go with its temporary folder: an ERROR cell's why must reach the log (a sweep's cells,
    written here as a test double)."""
    from harness.commands.bench_speed import _errors

    cells = [{"verdict": "UNSUPPORTED", "tokens": 1, "message": "no paddle", "sides": []},
             {"verdict": "ERROR", "tokens": 7, "message": "side a failed",
              "sides": [{"label": "a", "status": "error", "reason": "timed out", "stderr_tail": "x" * 5000 + "END"},
                        {"label": "b", "status": "ok", "reason": "", "stderr_tail": "fine"}]}]
    (error,) = _errors({"cells": cells})
    assert error["tokens"] == 7
    assert error["message"].startswith("side a failed a: timed out ")
    assert error["message"].endswith("END") and "fine" not in error["message"]


def test_the_code_digest_names_what_ran_and_moves_with_any_edit(tmp_path):
    from harness.commands.bench_speed import _code

    (tmp_path / "harness" / "run").mkdir(parents=True)
    (tmp_path / "cases").mkdir()
    (tmp_path / "harness" / "run" / "a.py").write_text("x = 1\n")
    (tmp_path / "cases" / "c.toml").write_text("[c]\n")
    first = _code(tmp_path)
    assert first == _code(tmp_path) and len(first) == 12
    (tmp_path / "harness" / "run" / "a.py").write_text("x = 2\n")
    assert _code(tmp_path) != first
    (tmp_path / "harness" / "run" / "a.py").write_text("x = 1\n")
    assert _code(tmp_path) == first
    (tmp_path / "harness" / "run" / "a.py").rename(tmp_path / "harness" / "run" / "b.py")  # same bytes, other name
    assert _code(tmp_path) != first
