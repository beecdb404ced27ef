"""The package tree follows the pipeline: no module imports a module of a later stage.

case (registry, op records, checkpoints), families (model family records), optimizers (optimizer records) -> run
(orchestration, launchers) -> runners (subprocess side), capture, attach (the recorder in a user's loop) -> compare,
baselines -> report -> levels (op, model, train: one record each) -> pipeline (one comparison at any level) ->
commands -> cli. `bits` is a shared utility every stage may use (so are `paths`, `resources`, `environments`: which
interpreter a family's HF side needs, read by case and run). A model family is data (harness/families/<family>/:
no Python); each framework builds every family in its runner's room (harness/runners/megatron/families.py,
harness/runners/torch/hf_families.py, harness/runners/paddle/families.py), so no module of the families' stage imports
a framework or a later stage. An optimizer's per-stack builders import their framework inside the function (only
runners call them).
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "harness"
STAGES = {"bits": 0, "paths": 0, "resources": 0, "environments": 0, "case": 1, "families": 1, "optimizers": 1, "run": 2,
          "runners": 3, "capture": 3, "attach": 3, "compare": 4, "baselines": 4, "report": 5, "levels": 6,
          "pipeline": 7,
          "commands": 8, "cli": 9, "__main__": 9, "__init__": 0}


def stage_of(module: str) -> str:
    """`harness.compare.tensors` -> "compare"; `harness` -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_of(path: Path) -> str:
    """harness/runners/torch/hf_model.py -> harness.runners.torch.hf_model."""
    return ".".join(("harness", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            modules.add(node.module)
            if node.module == "harness":  # from harness import bits, __version__
                modules.update(f"harness.{alias.name}" for alias in node.names if alias.name != "__version__")
        elif isinstance(node, ast.Import):
            modules.update(a.name for a in node.names if a.name.split(".")[0] == "harness")
    return modules


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_sits_in_a_known_stage():
    unknown = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in MODULES} - set(STAGES)
    assert not unknown, f"folders or modules outside the stages: {sorted(unknown)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_later_stage(path):
    own = stage_of(module_of(path))
    later = {m for m in imported_modules(path) if STAGES[stage_of(m)] > STAGES[own]}
    assert not later, f"{path.relative_to(PACKAGE)} ({own}) imports later stages: {sorted(later)}"


def test_the_check_sees_a_backward_import(tmp_path):
    """Negative control: a compare module that imports the report stage is caught."""
    bad = tmp_path / "bad.py"
    bad.write_text("from harness.report import case_report\nfrom harness import bits\n")
    found = imported_modules(bad)
    assert {m for m in found if STAGES[stage_of(m)] > STAGES["compare"]} == {"harness.report"}


def test_no_test_module_imports_another():
    """Shared test code lives in tests/support: a test module imported by another runs its tests twice."""
    tests = Path(__file__).resolve().parent
    offenders = {path.name: sorted(m for m in imported_test_modules(path)) for path in sorted(tests.glob("test_*.py"))}
    assert not {name: found for name, found in offenders.items() if found}


def imported_test_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found |= {n for n in names if n.startswith("tests.test_") or n.startswith("test_")}
    return found


def test_the_test_import_check_sees_one(tmp_path):
    (tmp_path / "test_x.py").write_text("from tests.test_report_blocks import assert_same_text\n")
    assert imported_test_modules(tmp_path / "test_x.py") == {"tests.test_report_blocks"}


def module_graph() -> dict[str, set[str]]:
    """harness module -> the harness modules it imports, anywhere in its file (a lazy import inside a function too)."""
    names = {".".join(("harness", *p.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in MODULES}
    graph = {}
    for name, path in names.items():
        found = set()
        for module in imported_names(path):
            while module and module not in names:  # harness.run.workers.Pool -> harness.run.workers
                module = module.rpartition(".")[0]
            if module and module != name:
                found.add(module)
        graph[name] = found
    return graph


def imported_names(path: Path) -> set[str]:
    """Every dotted harness name a file imports: `from harness.run import workers` gives harness.run.workers."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "harness":
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "harness"}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle, as the path that closes it (depth-first, the first one found through each module)."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for child in sorted(graph.get(node, ())):
            visit(child, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_two_modules_import_each_other_through_any_path():
    # a package's __init__ may import its own modules (it is imported by them anyway)
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in module_graph().items()}
    assert not cycles(graph)


def test_the_cycle_check_sees_a_lazy_import_back():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
