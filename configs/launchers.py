"""The launcher registry: the launchers `train.launcher` may name, one entry each, and what the config and the
planner know of each (whether it runs on this machine, the GPU counts per node the config itself fixes).

How each is built and checked lives a layer up, in the module its entry names (`module`, a dotted path: named,
not imported, so the config stays below the launch interface; `grpo_pipeline.infra.launch.launcher_kind` imports
it on use and reads its `KIND`). A new launcher is its module and one entry here: the config's allowed values, the
flow form's choices, how the job is built and checked, and every check that asks "is it local?" or "how many
GPUs?" follow from the entry (tests/unit/test_launchers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from grpo_pipeline.configs.train import TrainConfig


@dataclass(frozen=True)
class LauncherFacts:
    """One launcher as the config and the planner see it."""

    summary: str  # what it does, for `train.launcher`'s description
    # A subprocess on this machine: one node, planned against this machine's memory at 0 USD, its checkpoint store
    # reached from here, its machine metrics logged here. Otherwise it rents the GPUs `train.sky` describes.
    local: bool
    # Each GPU count per node the config asks for (one per accelerator option); None: the machine's own, known only
    # where the job runs. The launch interface's `gpus_per_node` answers for the job itself.
    gpu_counts: Callable[[TrainConfig], list[int] | None]
    # The module whose `KIND` (`grpo_pipeline.infra.launch.LauncherKind`) builds the launcher, the GPU counts its
    # nodes may have and its checks before any work.
    module: str


def sky_gpu_counts(train: TrainConfig) -> list[int]:
    """The GPUs per node each of `train.sky.accelerators`' options asks for; [] when unset (the task YAML's list,
    which only the launcher reads).

    >>> from grpo_pipeline.configs.train import TrainConfig
    >>> sky_gpu_counts(TrainConfig(launcher="sky", sky={"accelerators": ["H100:8", "A100", "L4:8"]}))
    [1, 8]
    """
    return sorted({int(option.partition(":")[2] or 1) for option in train.sky.accelerators or []})


def _machine_gpus(train: TrainConfig) -> None:
    return None


_LAUNCH = "grpo_pipeline.infra.launch"
LAUNCHERS: dict[str, LauncherFacts] = {
    "local": LauncherFacts("a subprocess here", local=True, gpu_counts=_machine_gpus, module=f"{_LAUNCH}.local"),
    "sky": LauncherFacts(
        "a SkyPilot managed job on spot GPUs", local=False, gpu_counts=sky_gpu_counts, module=f"{_LAUNCH}.skypilot"
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
