"""Named environments: a second HF stack beside the harness's own interpreter, for the side that needs it.

The harness's venv holds transformers 5.3.0, which the records and baselines of the families already here were made
with. A family whose HF class exists only in a later release (DeepSeek-V3.2: transformers 5.23.0) names the
environment its HF side runs in (``hf.toml``'s ``environment``); that side and the model's float64 truth are then
started with the environment's interpreter. Each is the main interpreter's packages with only the listed ones on top:
a venv without pip whose site-packages holds them (``pip install --no-deps --target``) and a ``.pth`` that adds the
creating interpreter's site-packages after them. ``make`` creates it (``python -m harness.environments NAME``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIELD = "environment"  # the hf.toml key that names one
BASE_PTH = "harness-base.pth"  # the .pth that puts the creating interpreter's packages after the environment's own


@dataclass(frozen=True)
class Environment:
    folder: str  # beside .venv, in the repository
    requirements: str  # its packages, each pinned (installed --no-deps over the main interpreter's)
    needs: str  # what a side without it is missing (an UNSUPPORTED reason names it)


ENVIRONMENTS = {"transformers-5.23.0": Environment(".venv-hf523", "requirements-hf523.txt",
                                                   "transformers 5.23.0 (and tokenizers 0.23.1)")}


def check(name: object, where: str) -> str:
    """`name` if it is a known environment; else ValueError naming `where` (a file), the field and the value."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"{where}: {FIELD} = {name!r}: not a known environment (known: {', '.join(ENVIRONMENTS)})")
    return name


def of_family(record) -> str | None:
    """The environment a family's HF side needs (its ``hf.toml``), None for the harness's own interpreter."""
    name = record.stack("hf").get(FIELD)
    return None if name is None else check(name, str(record.folder / "hf.toml"))


def python(name: str) -> str:
    return str(REPO_ROOT / ENVIRONMENTS[name].folder / "bin" / "python")


def missing(name: str) -> str:
    """Why a side cannot run in environment `name` here ("" when it can): an UNSUPPORTED reason naming the package."""
    env = ENVIRONMENTS[name]
    if (REPO_ROOT / env.folder / ".installed").exists() and os.access(python(name), os.X_OK):
        return ""
    return (f"{env.needs} is not installed: the environment {name!r} ({env.folder}, {env.requirements}) that this "
            f"side needs does not exist; `make {env.folder}/.installed` creates it")


def active() -> str | None:
    """The environment this interpreter is (None: the harness's own or a user's)."""
    here = Path(sys.prefix).resolve()
    return next((name for name, env in ENVIRONMENTS.items() if (REPO_ROOT / env.folder).resolve() == here), None)


def create(name: str) -> Path:
    """Create environment `name` afresh from this interpreter: a venv without pip, its packages, the base .pth."""
    env = ENVIRONMENTS[check(name, "python -m harness.environments")]
    folder = REPO_ROOT / env.folder
    shutil.rmtree(folder, ignore_errors=True)
    venv.EnvBuilder(symlinks=True, with_pip=False).create(folder)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(folder), "platbase": str(folder)}))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site),
                    "-r", str(REPO_ROOT / env.requirements)], check=True)
    (site / BASE_PTH).write_text(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
    (folder / ".installed").write_text(f"{sys.executable}\n")
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m harness.environments", description=create.__doc__)
    parser.add_argument("name", choices=ENVIRONMENTS)
    print(create(parser.parse_args().name))
