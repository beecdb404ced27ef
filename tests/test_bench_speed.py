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
