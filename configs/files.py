"""The data files the project ships (the GPU catalogue, the model architectures, the YAML recipes,
prefect.yaml), found inside the installed packages rather than beside a source checkout, so a non-editable
`pip install .` plans, validates and deploys as a checkout does. pyproject.toml's package-data lists them.

    >>> packaged("gpus.yaml").is_file(), packaged("models/qwen2.5-7b.json").is_file()
    (True, True)
    >>> names = [p.name for p in recipes()]; "demo-cpu.yaml" in names, "gpus.yaml" in names
    (True, False)
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

NOT_RECIPES = {"gpus.yaml"}  # the planner's GPU catalogue lies beside the recipes


def packaged(name: str, package: str = "configs") -> Path:
    """A file shipped in `package` ('models/x.json' for one in a sub-folder), where that package is installed."""
    # setuptools installs packages as plain directories, so the resource is a real file with a path
    return Path(str(resources.files(f"grpo_pipeline.{package}").joinpath(*name.split("/"))))


def recipes() -> list[Path]:
    """The shipped pipeline configs (configs/*.yaml but the GPU catalogue), by name."""
    return sorted(p for p in packaged("").glob("*.yaml") if p.name not in NOT_RECIPES)


def recipe(path: Path) -> Path:
    """`path` when it exists; else, when it is a relative `configs/NAME` or `NAME` of a shipped recipe, that
    recipe where the package is installed, so the README's commands work outside a checkout too.

    >>> recipe(Path("demo-cpu.yaml")) == packaged("demo-cpu.yaml"), recipe(Path("configs/demo-cpu.yaml")).is_file()
    (True, True)
    >>> str(recipe(Path("my-own.yaml"))), str(recipe(Path("/etc/configs/demo-cpu.yaml")))
    ('my-own.yaml', '/etc/configs/demo-cpu.yaml')
    """
    if path.exists() or path.is_absolute() or path.parent not in (Path("."), Path("configs")):
        return path
    shipped = packaged(path.name)
    return shipped if shipped.is_file() and shipped.name not in NOT_RECIPES else path


SOURCE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding the packages: a checkout, or site-packages


def project_file(path: str | Path) -> Path:
    """A project file named relative to the project root (e.g. `sky/train.yaml`): relative to the working
    directory when it is there (a user's own copy), else to the source checkout the packages run from.

    >>> project_file("sky/train.yaml").is_file(), str(project_file("/abs/x.yaml"))
    (True, '/abs/x.yaml')
    """
    path = Path(path)
    if path.is_absolute() or path.exists():
        return path
    beside_source = SOURCE_ROOT / path
    return beside_source if beside_source.exists() else path
