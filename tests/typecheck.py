"""mypy over the package under its installed names (`python -m tests.typecheck`; `make lint` runs it).

The wheel maps grpo_pipeline.configs/.trainer/.tasks/.infra/.flows to the checkout's top-level folders through
setuptools' package-dir, and an editable install reaches them through an import hook, which mypy cannot follow. So
this lays the installed layout as a tree of symlinks under build/typecheck/ (read from pyproject.toml, so it cannot
drift from the wheel), runs mypy on `-p grpo_pipeline` with pyproject.toml's [tool.mypy] settings, and prints each
finding at the file's path in the checkout. The exit code is mypy's: 0 only with zero findings.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
PACKAGE = "grpo_pipeline"


def lay_tree(root: Path = ROOT, tree: Path = TREE) -> dict[str, str]:
    """Symlink the installed package's layout under `tree`; return {tree path prefix: checkout path prefix}."""
    package_dir: dict[str, str] = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    shutil.rmtree(tree, ignore_errors=True)
    top = tree / PACKAGE
    top.mkdir(parents=True)
    for path in (root / PACKAGE).iterdir():
        if path.suffix == ".py" or (path / "__init__.py").is_file():
            (top / path.name).symlink_to(path)
    prefixes = {f"{top.relative_to(root)}/": f"{PACKAGE}/"}
    for name, folder in package_dir.items():
        link = tree.joinpath(*name.split("."))
        link.symlink_to(root / folder)
        prefixes[f"{link.relative_to(root)}/"] = f"{folder}/"
    return prefixes


def main() -> int:
    from mypy import api  # a dev dependency: imported here so collecting this module's doctests never needs it

    prefixes = lay_tree()
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "-p", PACKAGE])
    for tree_prefix in sorted(prefixes, key=len, reverse=True):  # the sub-packages' folders before the top's
        stdout = stdout.replace(tree_prefix, prefixes[tree_prefix])
    sys.stdout.write(stdout)
    sys.stderr.write(stderr)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
