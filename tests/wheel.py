"""The project's wheel, built as a user's `pip wheel` builds it, and a clean environment to install it into: the
packaging test and the deploy-from-a-wheel test share them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What setuptools builds the wheel from (pyproject.toml's packages and readme).
SOURCES = ("pyproject.toml", "README.md", "configs", "grpo_pipeline", "flows", "tasks", "trainer", "infra")


def build_wheel(work: Path) -> Path:
    """`pip wheel --no-deps` of a copy of the sources: setuptools writes build/ and *.egg-info into the tree it
    builds, and the checkout is shared. No build isolation: the venv's setuptools, no index needed."""
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            str(src),
            "-w",
            str(work / "dist"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (work / "dist").glob("grpo_pipeline-*.whl")
    return built


def third_party_paths() -> list[str]:
    """The site-packages folders this interpreter imports from (its venv's, and those its .pth files add, as a
    worktree's venv adds the main venv's): the dependencies, never the checkout itself."""
    return list(dict.fromkeys(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")))


def clean_venv(folder: Path, wheel: Path) -> Path:
    """A new virtual environment holding the wheel alone, which finds its third-party dependencies through a
    .pth file (a line of a .pth file is put on sys.path; the .pth files inside that folder, such as an editable
    install's import hook, are not run): nothing of the checkout can be imported there. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=300)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.strip()
    (Path(site) / "third_party.pth").write_text("\n".join(third_party_paths()) + "\n")
    # --ignore-installed: the checkout's own editable install may be listed in a folder the .pth names; it is
    # neither uninstalled nor imported (the wheel's copy comes first on sys.path)
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python
