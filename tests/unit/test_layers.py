"""The house's rule: layers from the ground up, and no import runs from a lower layer to a higher one.

    configs -> trainer -> tasks -> infra -> flows -> grpo_pipeline (the CLI)

`configs` and `trainer` import nothing else of the project: the config is pure pydantic, and the trainer is
what a GPU node runs alone. The exceptions, named in SHARED: the trainer imports the config's sections that its
job spec carries as they are, each defined once: `grpo_pipeline.configs.layout` (the distributed layout and its
two rules: world size, TRL's batch rule), `.health` (the health rules' table and section), `.sampling` (the
curriculum and dynamic sampling), `.rewards` (the RewardSet), `.dtypes` (the base's quantization modes and
dtypes), `.trainer_fields` (the train.* fields the trainer reads, which the config builds on too), `.base`
(`StrictModel`, what the job spec's models and those sections build on), and `.library_fields` (TRL's defaults
from the snapshot, for the node launcher's batch check without importing TRL); each imports nothing of the
project itself but those.
Every import is read with `ast`, those inside functions included.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline"]
LEAVES = {"configs", "trainer"}  # may import nothing of the project but themselves, and SHARED
# a leaf's allowed imports of a lower layer: module names
SHARED = {
    "trainer": {
        "grpo_pipeline.configs.base",
        "grpo_pipeline.configs.layout",
        "grpo_pipeline.configs.health",
        "grpo_pipeline.configs.sampling",
        "grpo_pipeline.configs.rewards",
        "grpo_pipeline.configs.dtypes",
        "grpo_pipeline.configs.trainer_fields",
        "grpo_pipeline.configs.library_fields",
    }
}


def layer_of(module: str) -> str:
    """The layer a module name belongs to: grpo_pipeline.tasks.data.stage -> tasks; grpo_pipeline.cli -> grpo_pipeline.

    >>> layer_of("grpo_pipeline.tasks.plan"), layer_of("grpo_pipeline.cli"), layer_of("torch.nn")
    ('tasks', 'grpo_pipeline', 'torch')
    """
    parts = module.split(".")
    if parts[0] == "grpo_pipeline" and len(parts) > 1 and parts[1] in LAYERS:
        return parts[1]
    return parts[0]


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, layer, module) of each import in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, layer_of(alias.name), alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "grpo_pipeline":  # from grpo_pipeline import tasks
                found += [
                    (node.lineno, layer_of(f"grpo_pipeline.{alias.name}"), f"grpo_pipeline.{alias.name}")
                    for alias in node.names
                ]
            else:
                found.append((node.lineno, layer_of(node.module), node.module))
    return found


def upward_imports() -> list[str]:
    bad = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for line, target, module in imports(path):
                if target not in LAYERS or target == layer or module in SHARED.get(layer, ()):
                    continue
                if layer in LEAVES or LAYERS.index(target) > LAYERS.index(layer):
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_no_import_runs_up_a_layer():
    assert upward_imports() == []


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The walk above is not vacuous: a config module that imports a task is caught."""
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "bad.py").write_text("def f():\n    from grpo_pipeline.tasks.plan import Plan\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert upward_imports() == ["configs/bad.py:2 imports tasks"]


def test_the_shared_config_modules_stay_leaves_and_the_only_exceptions(tmp_path, monkeypatch):
    """What the trainer may import of configs imports nothing of the project; any other configs module the
    trainer imports is caught."""
    shared = [
        imports(ROOT / (module.removeprefix("grpo_pipeline.").replace(".", "/") + ".py"))
        for modules in SHARED.values()
        for module in modules
    ]
    leaves = set().union(*SHARED.values())
    assert not [found for found in shared for _, target, module in found if target in LAYERS and module not in leaves]
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "bad.py").write_text(
        "from grpo_pipeline.configs.layout import world_size\nfrom grpo_pipeline.configs.schema import TrainConfig\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert upward_imports() == ["trainer/bad.py:2 imports configs"]


def test_the_config_sections_sit_below_the_schema_that_composes_them():
    """Each section of the configuration is a module of its own (configs/data.py, train.py, hpo.py, ...); the schema
    composes them into PipelineConfig, so a section that imported the schema would be a cycle. Every name the schema
    offered before the cut is still importable from it, as the section's own object."""
    import importlib

    from grpo_pipeline.configs import schema

    importers = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted((ROOT / "configs").glob("*.py"))
        if path.name != "schema.py"
        for line, _, module in imports(path)
        if module == "grpo_pipeline.configs.schema"
    ]
    assert importers == []
    for name in schema.__all__:
        value = getattr(schema, name)
        home = getattr(value, "__module__", None)
        if home is not None and home.startswith("grpo_pipeline.configs."):
            assert getattr(importlib.import_module(home), name) is value, name


HEAVY = ("torch", "transformers", "trl", "peft")
PROBE = f"""
import json, sys
from grpo_pipeline.cli import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["config"],
        ["config", "--set", "train.grpo.learning_rate=3e-4", "--set", "train.lora.r=8"],
        ["plan", "--config", "configs/demo-cpu.yaml"],
        ["plan", "--model", "qwen2.5-7b", "--quant", "nf4"],
    ],
    ids=lambda a: " ".join(a),
)
def test_config_and_plan_load_no_torch(args):
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "[]"


MAX_LINES = 600  # about where a module is cut along its seams (issue #36)


def test_a_module_past_the_line_limit_says_at_its_top_why_it_is_one():
    """A module over MAX_LINES lines is cut along a seam, or its docstring says why it is one ("One module, ...")."""
    unexplained = []
    for folder in [*LAYERS, "bench"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            if len(text.splitlines()) > MAX_LINES and "One module" not in (ast.get_docstring(ast.parse(text)) or ""):
                unexplained.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
    assert unexplained == [], unexplained
