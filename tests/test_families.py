"""The family registry: ``FAMILIES`` is found, not listed (every package under harness/families/ with its ``FAMILY``
record), DeepSeek-V3 first as the default, the others by name; a package without a record, or two records of one
name, is an error naming them."""

from pathlib import Path

import pytest

from harness.families import DEFAULT, FAMILIES, Family, discover

FOLDER = Path(__file__).resolve().parents[1] / "harness" / "families"


def test_every_family_package_is_registered_default_first_then_by_name():
    packages = sorted(p.name for p in FOLDER.iterdir() if (p / "__init__.py").is_file())
    assert list(FAMILIES) == [DEFAULT, *sorted(set(packages) - {DEFAULT})]
    for name, family in FAMILIES.items():
        assert isinstance(family, Family) and family.name == name and family.folder == FOLDER / name


def _package(root: Path, name: str, families: dict[str, str]) -> str:
    """A package `name` under `root` whose subpackages have the given ``__init__.py`` sources."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text("")
    (root / name / "helpers.py").write_text("")  # a module, not a family
    for sub, source in families.items():
        (root / name / sub).mkdir()
        (root / name / sub / "__init__.py").write_text(source)
    return name


def test_a_package_without_a_family_record_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _package(tmp_path, "families_without_record", {
        "good": "from harness.families.glm4_moe import FAMILY\n", "bare": "NOT_A_FAMILY = 1\n"})
    with pytest.raises(TypeError, match=r"families_without_record\.bare is a family package without a FAMILY"):
        discover(package)


def test_two_families_of_one_name_are_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    record = "from harness.families.glm4_moe import FAMILY\n"
    package = _package(tmp_path, "families_twice", {"one": record, "two": record})
    with pytest.raises(ValueError, match="two families named 'glm4_moe'"):
        discover(package)


def test_a_package_of_records_is_found_default_first(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    package = _package(tmp_path, "families_found", {
        "a_glm": "from harness.families.glm4_moe import FAMILY\n",
        "z_deepseek": "from harness.families.deepseek_v3 import FAMILY\n"})
    assert list(discover(package)) == [DEFAULT, "glm4_moe"]
