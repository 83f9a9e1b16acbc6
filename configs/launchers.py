"""The launcher registry: the launchers `train.launcher` may name, one entry each, and what the config, the planner
and the search know of each (whether it runs on this machine, the GPU counts per node the config itself fixes, and,
for one that rents GPUs, its GPU options, its prices, and the task file its search trials run).

How each is built and checked lives a layer up, in the module its entry names (`module`, a dotted path: named,
not imported, so the config stays below the launch interface; `grpo_pipeline.infra.launch.launcher_kind` imports
it on use and reads its `KIND`). A new launcher is its module and one entry here: the config's allowed values, the
flow form's choices, how the job is built and checked, what the planner prices and writes back, what a search trial
runs on, and every check that asks "is it local?" or "how many GPUs?" follow from the entry
(tests/unit/test_launchers.py). Only this module and the SkyPilot launcher itself read `train.sky`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import yaml

from grpo_pipeline.configs.files import project_file

if TYPE_CHECKING:
    from grpo_pipeline.configs.train import TrainConfig


@dataclass(frozen=True)
class Rental:
    """What the planner and the search read of a launcher that rents GPUs. GPU options are SkyPilot's spelling,
    `NAME` or `NAME:COUNT` (GPUs per node), which the planner's catalogue (configs/gpus.yaml) names too."""

    # The GPU names the planner chooses among when plan.allowed_gpus is unset, in the launcher's order: the
    # config's own list, else its task file's. ValueError (naming the file and the fix) when it cannot be read.
    gpu_options: Callable[[TrainConfig], list[str]]
    # GPU name -> GPUs per node, for each option the config pins ({}: the planner chooses the count)
    pinned_gpus: Callable[[TrainConfig], dict[str, int]]
    # Whether the plan prices the GPUs at spot rates (plan.spot, when set, overrides it)
    spot: Callable[[TrainConfig], bool]
    # The section that launches on the plan's fitting options (`NAME:COUNT`, cheapest first), unless the config
    # pins its own
    launch_on: Callable[[TrainConfig, list[str]], TrainConfig]
    # The section a search trial runs with: `hpo.trial_task_file` (None: the launcher's own trial task) and that
    # task's GPU list, not the one planned for training
    trial: Callable[[TrainConfig, str | None], TrainConfig]


@dataclass(frozen=True)
class LauncherFacts:
    """One launcher as the config, the planner and the search see it."""

    summary: str  # what it does, for `train.launcher`'s description
    # A subprocess on this machine: one node, planned against this machine's memory at 0 USD, its checkpoint store
    # reached from here, its machine metrics logged here. Otherwise it rents GPUs, and `rental` says which and how.
    local: bool
    # Each GPU count per node the config asks for (one per accelerator option); None: the machine's own, known only
    # where the job runs. The launch interface's `gpus_per_node` answers for the job itself.
    gpu_counts: Callable[[TrainConfig], list[int] | None]
    # The module whose `KIND` (`grpo_pipeline.infra.launch.LauncherKind`) builds the launcher, the GPU counts its
    # nodes may have and its checks before any work.
    module: str
    rental: Rental | None = None  # required where not local

    def __post_init__(self) -> None:
        if not self.local and self.rental is None:
            raise TypeError(f"{self.summary!r}: a launcher that rents GPUs gives the planner its `rental`")

    def rents(self) -> Rental:
        """This launcher's `Rental`; only a launcher that is not local has one (check `local` first)."""
        if self.rental is None:
            raise TypeError(f"{self.summary!r} runs here and rents nothing")
        return self.rental


def gpu_option(option: str) -> tuple[str, int]:
    """A GPU option as SkyPilot spells it, split: 'H100:8' -> ('H100', 8); a bare name is one GPU.

    >>> gpu_option("H100:8"), gpu_option("L4")
    (('H100', 8), ('L4', 1))
    """
    name, _, count = str(option).partition(":")
    return name, int(count or 1)


def sky_gpu_counts(train: TrainConfig) -> list[int]:
    """The GPUs per node each of `train.sky.accelerators`' options asks for; [] when unset (the task YAML's list,
    which only the launcher reads).

    >>> from grpo_pipeline.configs.train import TrainConfig
    >>> sky_gpu_counts(TrainConfig(launcher="sky", sky={"accelerators": ["H100:8", "A100", "L4:8"]}))
    [1, 8]
    """
    return sorted({gpu_option(option)[1] for option in train.sky.accelerators or []})


def sky_task_gpus(task_yaml: str) -> list[str]:
    """GPU names a SkyPilot task YAML asks for (resources.accelerators or resources.ordered/any_of); a relative
    path is the project root's (`grpo_pipeline.configs.files.project_file`), where SkyPilot takes its workdir from.

    >>> sky_task_gpus("sky/train.yaml"), sky_task_gpus("sky/hpo-trial.yaml")
    (['H100', 'A100-80GB', 'L40S'], ['L4', 'A10G', 'L40S'])
    """
    try:
        resources = (yaml.safe_load(project_file(task_yaml).read_text()) or {}).get("resources") or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(
            f"cannot read {task_yaml} for its GPU list ({exc}); run from the project root, or set "
            "plan.allowed_gpus or train.sky.accelerators"
        ) from None
    names: list[str] = []
    for entry in resources.get("ordered") or resources.get("any_of") or [resources]:
        acc = entry.get("accelerators")
        for item in acc if isinstance(acc, (list, dict)) else [acc] if acc else []:
            names.append(gpu_option(item)[0])
    return list(dict.fromkeys(names))


def _sky_gpu_options(train: TrainConfig) -> list[str]:
    if train.sky.accelerators:
        return list(dict.fromkeys(gpu_option(a)[0] for a in train.sky.accelerators))
    return sky_task_gpus(train.sky.task_yaml)


def _sky_pinned(train: TrainConfig) -> dict[str, int]:
    pinned: dict[str, int] = {}
    for option in train.sky.accelerators or []:
        name, count = gpu_option(option)
        pinned.setdefault(name, count)
    return pinned


def _sky_launch_on(train: TrainConfig, options: list[str]) -> TrainConfig:
    if train.sky.accelerators is not None:
        return train
    return train.model_copy(update={"sky": train.sky.model_copy(update={"accelerators": options})})


SKY_TRIAL_TASK = "sky/hpo-trial.yaml"  # trials are short: cheaper GPUs, no retry after a crash


def _sky_trial(train: TrainConfig, task_file: str | None) -> TrainConfig:
    sky = train.sky.model_copy(update={"task_yaml": task_file or SKY_TRIAL_TASK, "accelerators": None})
    return train.model_copy(update={"sky": sky})


SKY = Rental(
    gpu_options=_sky_gpu_options,
    pinned_gpus=_sky_pinned,
    spot=lambda train: train.sky.use_spot,
    launch_on=_sky_launch_on,
    trial=_sky_trial,
)


def _machine_gpus(train: TrainConfig) -> None:
    return None


_LAUNCH = "grpo_pipeline.infra.launch"
LAUNCHERS: dict[str, LauncherFacts] = {
    "local": LauncherFacts("a subprocess here", local=True, gpu_counts=_machine_gpus, module=f"{_LAUNCH}.local"),
    "sky": LauncherFacts(
        "a SkyPilot managed job on spot GPUs",
        local=False,
        gpu_counts=sky_gpu_counts,
        module=f"{_LAUNCH}.skypilot",
        rental=SKY,
    ),
}

# The names as types: pydantic, the JSON schema and the Prefect form read the Literal built from the table, so a new
# entry is a new allowed value; mypy cannot read a Literal built at run time, and sees a str.
if TYPE_CHECKING:
    LauncherName = str
    LauncherChoice = str
else:
    LauncherName = Literal[tuple(LAUNCHERS)]
    # the flow form's `launcher`: a launcher, or `config` to keep the config's own train.launcher
    LauncherChoice = Literal[("config", *LAUNCHERS)]


def launcher_help() -> str:
    """`train.launcher`'s description, one clause per launcher.

    >>> launcher_help()
    'local: a subprocess here; sky: a SkyPilot managed job on spot GPUs'
    """
    return "; ".join(f"{name}: {facts.summary}" for name, facts in LAUNCHERS.items())


def rented() -> str:
    """The launchers that rent machines, as a config value names them ('sky', or 'sky|k8s').

    >>> rented()
    'sky'
    """
    return "|".join(name for name, facts in LAUNCHERS.items() if not facts.local)
