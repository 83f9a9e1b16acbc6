"""The launcher registry: the config's table (configs/launchers.py: is it local, the GPU counts the config fixes) and
the launch interface's (infra/launch: how each is built and checked) name the same launchers, a new launcher is its
module and an entry in each, and nothing else asks which launcher it is by name."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.infra.launch import LAUNCHER_MODULES, launcher_kind
from grpo_pipeline.tasks.plan.stage import pinned_world

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = {ROOT / "configs" / "launchers.py", ROOT / "infra" / "launch" / "__init__.py"}


def test_both_tables_name_the_same_launchers_and_each_module_defines_its_kind():
    assert list(LAUNCHER_MODULES) == list(LAUNCHERS)
    for name in LAUNCHERS:
        kind = launcher_kind(name)
        assert callable(kind.build) and callable(kind.gpus_per_node) and callable(kind.check), name


def test_the_facts_the_config_and_the_plan_read():
    local, sky = load_config(None), load_config(None, ["train.launcher=sky", "train.sky.accelerators=[H100:4,A100:4]"])
    assert LAUNCHERS["local"].local and not LAUNCHERS["sky"].local
    assert LAUNCHERS["local"].gpu_counts(local.train) is None  # the machine's own, known where it runs
    assert LAUNCHERS["sky"].gpu_counts(sky.train) == [4]
    assert (pinned_world(local.train), pinned_world(sky.train)) == (None, 4)


def test_the_flow_form_offers_every_launcher():
    from prefect.utilities.callables import parameter_schema

    from grpo_pipeline.flows.pipeline import grpo_pipeline

    form = parameter_schema(grpo_pipeline.fn).model_dump()["properties"]["launcher"]
    assert form["enum"] == ["config", *LAUNCHERS] and form["default"] == "config"


def _launcher_comparisons(path: Path, root: Path = ROOT) -> list[str]:
    """`x.launcher == "sky"`-like tests in a file: a launcher asked for by name instead of by its entry."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(s, ast.Attribute) and s.attr == "launcher") or (isinstance(s, ast.Name) and s.id == "launcher")
            for s in sides
        )
        literal = any(isinstance(s, ast.Constant) and s.value in LAUNCHERS for s in sides)
        if named and literal:
            found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_module_outside_the_registry_tests_a_launcher_by_name(tmp_path):
    layers = ["configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline"]
    sources = [p for layer in layers for p in sorted((ROOT / layer).rglob("*.py")) if p not in REGISTRY]
    assert [hit for path in sources for hit in _launcher_comparisons(path)] == []
    bad = tmp_path / "bad.py"  # the walk is not vacuous
    bad.write_text('def f(train, launcher):\n    return "sky" != train.launcher or launcher in ("local",)\n')
    assert _launcher_comparisons(bad, tmp_path) == ["bad.py:2"]


NEW_LAUNCHER = """
from grpo_pipeline.infra.launch import LauncherKind

CHECKED = []


class RackLauncher:
    def __init__(self, train):
        self.train = train


KIND = LauncherKind(
    build=lambda train, on_line, on_status: RackLauncher(train),
    gpus_per_node=lambda train: [0],
    check=lambda train, mlflow_uri: CHECKED.append(mlflow_uri),
)
"""

WITH_IT = """
import sys
import types
from pathlib import Path

import grpo_pipeline.configs

# configs/launchers.py with one more entry, as its source would have it: the names become types at import
path = Path(grpo_pipeline.configs.__path__[0]) / "launchers.py"
table = "LAUNCHERS: dict[str, LauncherFacts] = {\\n"
source = path.read_text()
assert table in source
entry = '    "rack": LauncherFacts("our own rack", local=False, gpu_counts=lambda train: [8]),\\n'
module = sys.modules["grpo_pipeline.configs.launchers"] = types.ModuleType("grpo_pipeline.configs.launchers")
exec(compile(source.replace(table, table + entry), str(path), "exec"), module.__dict__)

from grpo_pipeline.infra import launch

launch.LAUNCHER_MODULES["rack"] = "rack_launcher"  # infra's table is read on use: its entry, added here

from typing import get_args

import rack_launcher
from grpo_pipeline.configs.schema import TrainConfig, load_config
from grpo_pipeline.tasks.plan.stage import pinned_world

cfg = load_config(None, ["train.launcher=rack", "train.distributed.nodes=2", "train.checkpoint_uri=s3://b/p"])
assert TrainConfig.model_json_schema()["properties"]["launcher"]["enum"] == ["rack", "local", "sky"]
assert "rack: our own rack" in TrainConfig.model_json_schema()["properties"]["launcher"]["description"]
assert get_args(module.LauncherChoice) == ("config", "rack", "local", "sky")  # the flow form's choices
assert type(launch.make_launcher(cfg.train)).__name__ == "RackLauncher"
launch.check_launcher(cfg.train, "http://mlflow:5000")
assert rack_launcher.CHECKED == ["http://mlflow:5000"]
assert pinned_world(cfg.train) == 16  # two nodes of the 8 GPUs its entry says the config fixes
print("ok")
"""


def test_a_new_launcher_is_its_module_and_one_entry_in_each_table(tmp_path):
    """An entry in the config's table (in its source: the names become types when it is imported) and one in the
    launch interface's: the config accepts the name (and, for a launcher that rents machines, several nodes), the
    flow form offers it (`LauncherChoice`, its type: test_the_flow_form_offers_every_launcher), the planner reads its
    GPU counts, the launch interface builds and checks it."""
    (tmp_path / "rack_launcher.py").write_text(NEW_LAUNCHER)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WITH_IT)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
