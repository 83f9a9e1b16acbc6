"""The wheel installs one top-level package, `grpo_pipeline`, and carries every data file the code finds through
its packages (configs/files.py: the GPU catalogue, the model architectures, the recipes, the TRL/PEFT field
snapshot, prefect.yaml); the `plan` command answers from the wheel's contents alone, away from the checkout and
beside another project's own `tasks` and `configs` packages, loading neither torch nor transformers."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.wheel import ROOT, build_wheel, third_party_paths


def data_files() -> set[str]:
    """The checkout's data files that product code opens by package (not test or benchmark inputs), as the
    wheel names them (under grpo_pipeline/)."""
    configs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*") if p.suffix in (".yaml", ".json")}
    return {f"grpo_pipeline/{name}" for name in configs | {"flows/prefect.yaml"}}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_the_wheel_installs_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"grpo_pipeline", wheel.name.split("-py3")[0] + ".dist-info"}
    for layer in (
        "configs",
        "trainer",
        "trainer/rewards",
        "tasks",
        "tasks/plan",
        "tasks/hpo",
        "tasks/data",
        "tasks/promote",
        "tasks/serve",
        "infra",
        "infra/launch",
        "flows",
        "flows/stages",
    ):
        assert f"grpo_pipeline/{layer}/__init__.py" in names, layer


def test_the_wheel_carries_the_data_files(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = data_files()
    assert {
        "grpo_pipeline/configs/gpus.yaml",
        "grpo_pipeline/configs/demo-cpu.yaml",
        "grpo_pipeline/configs/library_fields.json",
        "grpo_pipeline/flows/prefect.yaml",
        "grpo_pipeline/configs/models/qwen2.5-7b.json",
    } <= expected  # what the list below must hold, at the least
    assert expected <= names, sorted(expected - names)


# Run from the unpacked wheel: `-S` skips site-packages' .pth files, so the checkout's editable finder is not
# installed and only the wheel's copy of the project can be imported; the venv's third-party packages are
# on PYTHONPATH after it.
FROM_WHEEL = """
import json, sys
from typer.main import get_command
from grpo_pipeline.cli import app
results = []
for args in (["plan", "--model", "qwen2.5-7b", "--quant", "nf4", "--json"],
             ["plan", "--config", "configs/demo-cpu.yaml", "--json"]):
    rc = get_command(app).main(args, standalone_mode=False) or 0
    results.append(rc)
project = {m: getattr(mod, "__file__", None) for m, mod in sys.modules.items()
           if m.split(".")[0] == "grpo_pipeline" and m.count(".") <= 1}
others = {m: getattr(sys.modules[m], "__file__", None) for m in ("tasks", "configs") if m in sys.modules}
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"rc": results, "project": project, "others": others, "heavy": heavy}), file=sys.stderr)
"""


def test_plan_answers_from_the_wheel_alone(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"  # no checkout here: configs/demo-cpu.yaml is the packaged recipe
    for other in ("tasks", "configs"):  # another project's packages of the same names, first on sys.path
        (elsewhere / other).mkdir(parents=True)
        (elsewhere / other / "__init__.py").write_text("raise ImportError('the other project was imported')\n")
    # the venv's own packages and those its .pth files add (-S reads no .pth file)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *third_party_paths()])}
    proc = subprocess.run(
        [sys.executable, "-S", "-c", FROM_WHEEL], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stderr.strip().splitlines()[-1])
    assert report["rc"] == [0, 0], proc.stderr[-3000:]
    assert report["heavy"] == []
    assert {"grpo_pipeline.configs", "grpo_pipeline.tasks", "grpo_pipeline.cli"} <= set(report["project"])
    for package, file in report["project"].items():
        assert file and Path(file).is_relative_to(site), (package, file)
    assert report["others"] == {}  # nothing imported the other project's tasks or configs
    first, second = _json_documents(proc.stdout)
    assert first["model"] == "qwen2.5-7b" and first["workload"]["quantization"] == "nf4"
    assert second["model"] == "smollm2-135m" and second["settings"]["gpu"] == "local-cpu"


def _json_documents(text: str) -> list:
    """The JSON documents printed one after another."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if text[at].isspace():
            at += 1
            continue
        obj, end = decoder.raw_decode(text, at)
        out.append(obj)
        at = end
    return out
