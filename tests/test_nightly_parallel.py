"""Nightly cells at once (`--workers`: each cell on its own GPUs) and over hosts (`--shard i/n`, `nightly-merge`).

The real runs use the truth oracle on both sides (numpy only, a second each), so they test the scheduling and
the merge, not a framework.
"""

import json
import threading
import time

import pytest

from harness.case.registry import Registry
from harness.cli import main
from harness.run import orchestrate, placement
from tests.support.cases import tiny_case

ORACLE_CASES = "".join((
    tiny_case("one", seed=1, runners=["oracle", "oracle"], devices=["cpu"]),
    tiny_case("two", base="one", seed=2),
    tiny_case("three", base="one", seed=3),
    tiny_case("four_flipped", base="one", perturb={"side": "b", "tensor": "input", "index": [1, 2], "bit": 3}),
))


def test_each_cell_gets_its_own_gpus_and_tp_cells_take_tp_of_them():
    busy, lock, seen, overlaps = set(), threading.Lock(), [], []

    def work(tp):
        gpus = placement.runner_env_overrides()["CUDA_VISIBLE_DEVICES"].split(",")
        with lock:
            if busy & set(gpus):
                overlaps.append(gpus)
            busy.update(gpus)
        time.sleep(0.05)
        with lock:
            busy.difference_update(gpus)
        seen.append((tp, gpus))
        return len(gpus)

    items = [1, 2, 1, 4, 2, 1, 1, 1]
    counts = placement.run_cells(items, work, workers=4, device="gpu", tp_of=lambda tp: tp, gpus=["0", "1", "2", "3"])
    assert counts == items  # in order, each with as many GPUs as its TP size
    assert not overlaps
    assert all(set(gpus) <= {"0", "1", "2", "3"} for _, gpus in seen)


def test_cells_share_a_gpu_up_to_cells_per_gpu_and_a_tp_cells_gpus_stay_distinct():
    use, lock, most, together = {}, threading.Lock(), {}, []

    def work(tp):
        gpus = placement.runner_env_overrides()["CUDA_VISIBLE_DEVICES"].split(",")
        with lock:
            for gpu in gpus:
                use[gpu] = use.get(gpu, 0) + 1
                most[gpu] = max(most.get(gpu, 0), use[gpu])
            together.append(sum(use.values()))
        time.sleep(0.2)
        with lock:
            for gpu in gpus:
                use[gpu] -= 1
        return gpus

    items = [1, 1, 2, 1, 1, 1, 2, 1, 1, 1]
    placed = placement.run_cells(items, work, workers=8, device="gpu", tp_of=lambda tp: tp, gpus=["0", "1"],
                                 cells_per_gpu=3)
    assert [len(set(gpus)) for gpus in placed] == items  # a TP=2 cell on two distinct GPUs
    assert max(most.values()) == 3  # never more than 3 cells on a GPU, and the slots were used
    assert max(together) > 2  # more cells at once than GPUs
    with pytest.raises(placement.PlacementError, match="at least 1"):
        placement.GpuPool(["0"], cells_per_gpu=0)


def test_a_cell_needing_more_gpus_than_given_fails_alone():
    results = placement.run_cells([1, 8], lambda tp: "ran", workers=2, device="gpu", tp_of=lambda tp: tp,
                                  gpus=["0", "1"], on_error=lambda tp, error: str(error))
    assert results[0] == "ran"
    assert "needs 8 GPUs, this process was given 2" in results[1]


def test_visible_gpus_come_from_cuda_visible_devices():
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3, 5"}) == ["2", "3", "5"]
    assert placement.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_runner_env_carries_the_cells_placement_and_only_inside_it():
    with placement.runner_env({"CUDA_VISIBLE_DEVICES": "3"}):
        assert orchestrate.runner_env("gpu")["CUDA_VISIBLE_DEVICES"] == "3"
    assert orchestrate.runner_env("gpu").get("CUDA_VISIBLE_DEVICES") == __import__("os").environ.get(
        "CUDA_VISIBLE_DEVICES")


def test_a_gpu_runner_compiles_its_triton_kernels_into_the_harness_folder(monkeypatch):
    """The step digests' Triton kernel caches its build under checkpoints/, not the user's ~/.triton; a user's own
    TRITON_CACHE_DIR wins; a CPU runner is given none."""
    from pathlib import Path

    from harness.case.checkpoints import CHECKPOINTS_DIR

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert Path(orchestrate.runner_env("gpu")["TRITON_CACHE_DIR"]).parent == CHECKPOINTS_DIR
    assert "TRITON_CACHE_DIR" not in orchestrate.runner_env("cpu")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")
    assert orchestrate.runner_env("gpu")["TRITON_CACHE_DIR"] == "/elsewhere"


def test_workers_and_cores_do_not_move_the_runner_threads(monkeypatch):
    """The thread count changes bits (measured on this project's Intel AMX CPU at 16 tokens: kimi_shared_fc1_fp32 is
    DIFF at 1 thread and BITWISE_PASS at 2; kimi_router's and kimi_mla_q_a's bits move between 1 and 2), so neither
    `--workers` nor the machine's core count may set it (before: cores / workers)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    threads = placement.run_cells([1, 2], lambda _: orchestrate.runner_env("cpu")["OMP_NUM_THREADS"],
                                  workers=2, device="cpu")
    assert threads == [orchestrate.RUNNER_THREADS] * 2 == ["2", "2"]
    assert orchestrate.runner_env("cpu")["MKL_NUM_THREADS"] == "2"
    assert {k: orchestrate.runner_env("cpu")[k] for k in ("GOMP_SPINCOUNT", "KMP_BLOCKTIME")} == {
        "GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}  # waiting threads yield the shared cores
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    assert orchestrate.runner_env("cpu")["KMP_BLOCKTIME"] == "200"  # the user's own setting wins
    monkeypatch.setenv("OMP_NUM_THREADS", "8")  # a user's own choice is kept (and recorded in the fingerprint)
    assert orchestrate.runner_env("cpu")["OMP_NUM_THREADS"] == "8"


@pytest.fixture
def oracle_registry(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "t.toml").write_text(ORACLE_CASES)
    return tmp_path


def night(folder):
    [report] = folder.glob("nightly-*/report.json")
    return json.loads(report.read_text()), report.parent


def test_shards_run_concurrently_and_merge_into_one_night(oracle_registry):
    root = oracle_registry
    common = ["--cases", str(root / "cases"), "nightly", "--checkpoints", str(root / "ck"), "--workers", "2"]
    codes = [main([*common, "--shard", f"{i}/2", "--reports", str(root / f"shard{i}")]) for i in (1, 2)]
    first, first_dir = night(root / "shard1")
    second, second_dir = night(root / "shard2")
    order = [case.name for case in Registry.load(root / "cases").for_device("cpu")]
    assert [c["case"] for c in first["cases"]] == order[0::2]
    assert [c["case"] for c in second["cases"]] == order[1::2]
    assert first["shard"] == {"index": 1, "count": 2, "cases": order[0::2]} and first["workers"] == 2
    assert codes == [0, 0]  # a shard alone judges nothing: the merge does

    code = main(["nightly-merge", str(second_dir), str(first_dir), "--reports", str(root / "merged")])
    merged, merged_dir = night(root / "merged")
    assert code == 1 == merged["exit_code"]
    assert [c["case"] for c in merged["cases"]] == order
    assert merged["summary"] == {"total": 4, "passed": 3, "failed": 1, "skipped": 0,
                                 "failed_by": {"unknown": 1}}  # four_flipped differs and states nothing
    assert [s["index"] for s in merged["merged_from"]] == [2, 1] and merged["missing_shards"] == []
    for entry in merged["cases"]:
        assert (merged_dir / entry["report"]).is_file()  # each case's own folder travels with the night
    assert (merged_dir / "junit.xml").is_file() and "four_flipped" in (merged_dir / "report.md").read_text()


def test_a_missing_shard_fails_the_merged_night(oracle_registry):
    root = oracle_registry
    main(["--cases", str(root / "cases"), "nightly", "--checkpoints", str(root / "ck"), "--shard", "1/2",
          "--reports", str(root / "shard1")])
    _, first_dir = night(root / "shard1")
    assert main(["nightly-merge", str(first_dir), "--reports", str(root / "merged")]) == 1
    merged, _ = night(root / "merged")
    assert merged["missing_shards"] == [2]
    assert any("shard 2 of 2 is missing" in c["message"] for c in merged["cases"])


def test_merging_the_same_shard_twice_is_refused(oracle_registry, capsys):
    root = oracle_registry
    main(["--cases", str(root / "cases"), "nightly", "--checkpoints", str(root / "ck"), "--shard", "2/2",
          "--reports", str(root / "shard2")])
    _, folder = night(root / "shard2")
    assert main(["nightly-merge", str(folder), str(folder), "--reports", str(root / "merged")]) == 2
    assert "shard numbers repeat" in capsys.readouterr().err


def test_a_nightly_cell_takes_a_gpu_for_every_rank_of_its_sides(tmp_path, monkeypatch):
    """A TP=2 case and a training case on 2 data-parallel ranks each need 2 GPUs (a rank on a GPU its cell was not
    given would end the side ERROR). The placement is a test double: it records what each cell asks for."""
    from harness import CompareOptions
    from harness.commands import nightly
    from tests.support.cases import write_cases
    from tests.support.train import TINY_TRAIN, tiny_train_case

    cases = write_cases(tmp_path, tiny_case("tp2", tp=2, runners=["megatron", "paddle"], devices=["gpu"]),
                        tiny_train_case("dp2", devices=["gpu"], train={**TINY_TRAIN, "dp": 2}),
                        tiny_train_case("dp1", devices=["gpu"]))
    asked = {}

    def placed(cells, one, *, tp_of, **_):
        asked.update({case.name: tp_of(case) for case in cells})
        return []

    monkeypatch.setattr(nightly.placement, "run_cells", placed)
    monkeypatch.setattr(nightly.doctor, "run", lambda device, pythons, runners: {"kind": "doctor", "test_double": True})
    nightly.run(CompareOptions(device="gpu", cases_dir=cases, reports_dir=tmp_path / "reports",
                               checkpoints_dir=tmp_path / "checkpoints"), previous=None)
    assert asked == {"tp2": 2, "dp2": 2, "dp1": 1}
