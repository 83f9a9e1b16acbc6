"""The launcher registry: one table (configs/launchers.py), an entry per launcher with what the config, the planner and
the search know of it (is it local, the GPU counts the config fixes, for one that rents GPUs its GPU options, prices
and trial task) and the module a layer up whose `KIND` builds and checks it; a new launcher is its module and one
entry, nothing else asks which launcher it is by name, and nothing else reads `train.sky`."""

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.infra import launch
from grpo_pipeline.infra.launch import launcher_kind
from grpo_pipeline.tasks.plan.stage import pinned_world

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = {ROOT / "configs" / "launchers.py"}


def test_each_entry_names_a_module_of_the_launch_interface_that_defines_its_kind():
    for name, facts in LAUNCHERS.items():
        assert facts.module.startswith(f"{launch.__name__}."), name  # the built-in launchers live beside it
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


def _launcher_tables(path: Path, root: Path = ROOT) -> list[str]:
    """Dicts keyed by every launcher's name in a file: a second table of launchers, to be kept equal to the one."""
    return [
        f"{path.relative_to(root)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Dict) and set(LAUNCHERS) <= {k.value for k in node.keys if isinstance(k, ast.Constant)}
    ]


def test_no_module_outside_the_registry_tests_a_launcher_by_name(tmp_path):
    layers = ["configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline"]
    sources = [p for layer in layers for p in sorted((ROOT / layer).rglob("*.py")) if p not in REGISTRY]
    assert [hit for path in sources for hit in _launcher_comparisons(path)] == []
    assert [hit for path in sources for hit in _launcher_tables(path)] == []
    bad = tmp_path / "bad.py"  # the walks are not vacuous
    bad.write_text(
        'def f(train, launcher):\n    return "sky" != train.launcher or launcher in ("local",)\n\n\n'
        'MODULES = {"local": "launch.local", "sky": "launch.skypilot"}\n'
    )
    assert _launcher_comparisons(bad, tmp_path) == ["bad.py:2"] and _launcher_tables(bad, tmp_path) == ["bad.py:5"]


# what may read `train.sky`: the registry, and the SkyPilot launcher it names for `sky`
SKY_READERS = REGISTRY | {ROOT / "infra" / "launch" / "skypilot.py"}


def _sky_reads(path: Path, root: Path = ROOT) -> list[str]:
    """`<anything>.sky` attribute reads in a file: the SkyPilot section read outside its launcher's entry."""
    return [
        f"{path.relative_to(root)}:{node.lineno}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "sky"
    ]


def test_only_the_registry_and_the_sky_launcher_read_the_sky_section(tmp_path):
    """The planner and the search ask the launcher's entry (`Rental`) for GPU options, prices and the trial task."""
    layers = ["configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline"]
    sources = [p for layer in layers for p in sorted((ROOT / layer).rglob("*.py")) if p not in SKY_READERS]
    assert [hit for path in sources for hit in _sky_reads(path)] == []
    bad = tmp_path / "bad.py"  # the walk is not vacuous
    bad.write_text("def f(cfg):\n    return cfg.train.sky.accelerators\n")
    assert _sky_reads(bad, tmp_path) == ["bad.py:2"]


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
entry = '''    "rack": LauncherFacts(
        "our own rack",
        local=False,
        gpu_counts=lambda train: [8],
        module="rack_launcher",
        rental=Rental(
            gpu_options=lambda train: ["A100-80GB"],
            pinned_gpus=lambda train: {"A100-80GB": 8},
            spot=lambda train: False,
            launch_on=lambda train, options: train.model_copy(update={"s3_endpoint_url": "http://" + options[0]}),
            trial=lambda train, task_file: train.model_copy(update={"checkpoint_uri": task_file}),
        ),
    ),
'''
module = sys.modules["grpo_pipeline.configs.launchers"] = types.ModuleType("grpo_pipeline.configs.launchers")
exec(compile(source.replace(table, table + entry), str(path), "exec"), module.__dict__)

from grpo_pipeline.infra import launch
from typing import get_args

import rack_launcher
from grpo_pipeline.configs.schema import TrainConfig, load_config
from grpo_pipeline.tasks.hpo.space import trial_train
from grpo_pipeline.tasks.plan import apply_plan, load_model_config, plan_for_config
from grpo_pipeline.tasks.plan.stage import pinned_world

cfg = load_config(
    None,
    [
        "train.launcher=rack",
        "train.distributed.nodes=2",
        "train.checkpoint_uri=s3://b/p",
        "model.base=qwen2.5-0.5b",
        "train.grpo.max_steps=10",
        "hpo.trial_task_file=s3://b/trials",
    ],
)
assert TrainConfig.model_json_schema()["properties"]["launcher"]["enum"] == ["rack", "local", "sky"]
assert "rack: our own rack" in TrainConfig.model_json_schema()["properties"]["launcher"]["description"]
assert get_args(module.LauncherChoice) == ("config", "rack", "local", "sky")  # the flow form's choices
assert type(launch.make_launcher(cfg.train)).__name__ == "RackLauncher"
launch.check_launcher(cfg.train, "http://mlflow:5000")
assert rack_launcher.CHECKED == ["http://mlflow:5000"]
assert pinned_world(cfg.train) == 16  # two nodes of the 8 GPUs its entry says the config fixes
# the planner prices its GPU options as it rents them, and it writes the plan's choice back
plan = plan_for_config(cfg.model, cfg.train, cfg.plan, load_model_config("qwen2.5-0.5b")[1], "qwen2.5-0.5b")
assert (plan.settings.gpu, plan.settings.count, plan.estimate.pricing) == ("A100-80GB", 8, "on-demand"), plan
assert apply_plan(cfg, plan).train.s3_endpoint_url == "http://A100-80GB:8"
# a search trial runs on its trial task
assert trial_train(cfg.train, cfg.hpo, {}).checkpoint_uri == "s3://b/trials"
print("ok")
"""


def test_a_new_launcher_is_its_module_and_one_entry(tmp_path):
    """One entry in the registry (in its source: the names become types when it is imported), naming its module:
    the config accepts the name (and, for a launcher that rents machines, several nodes), the flow form offers it
    (`LauncherChoice`, its type: test_the_flow_form_offers_every_launcher), the planner reads its GPU counts, the
    launch interface builds and checks it from its module; the planner prices its GPU options and writes its choice
    back, and a search trial runs on its trial task, all through the entry's `Rental`."""
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
