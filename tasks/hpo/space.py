"""The search space as configuration: a trial's parameters, the config paths they set, and a trial's `train` section."""

from __future__ import annotations

import math
import os
from typing import Any

import optuna

from grpo_pipeline.configs.launchers import LAUNCHERS
from grpo_pipeline.configs.library_fields import grpo_value
from grpo_pipeline.configs.schema import (
    ConfigError,
    HPOConfig,
    PipelineConfig,
    SearchDim,
    SearchSpace,
    TrainConfig,
    set_path,
)

# Searched name -> the config path it sets (lora_alpha_ratio sets train.lora.lora_alpha = ratio x rank).
TARGETS = {
    "lora_r": "train.lora.r",
    "learning_rate": "train.grpo.learning_rate",
    "beta": "train.grpo.beta",
    "num_generations": "train.grpo.num_generations",
    "temperature": "train.grpo.temperature",
}


ALPHA = "train.lora.lora_alpha"


DEFAULT_LORA_R = 8  # peft.LoraConfig's default rank, when neither the space nor train.lora sets one


INTEGER = ("lora_r", "num_generations")  # searched as integers


def _typed(value: Any, integer: bool) -> int | float:
    return int(value) if integer else float(value)


def suggest(trial: optuna.trial.BaseTrial, space: SearchSpace) -> dict[str, Any]:
    """Ask the trial for a value of every searched dimension.

    >>> space = SearchSpace(lora_alpha_ratio=None)
    >>> suggest(optuna.trial.FixedTrial({"lora_r": 16, "learning_rate": 2e-4}), space)
    {'lora_r': 16, 'learning_rate': 0.0002}
    """
    params: dict[str, Any] = {}
    for name, dim in space.active().items():
        integer = name in INTEGER
        if dim.choices is not None:
            choices = [_typed(c, integer) for c in dim.choices]
            params[name] = trial.suggest_categorical(name, choices)
        elif integer:
            assert dim.low is not None and dim.high is not None  # SearchDim: a range without choices
            params[name] = trial.suggest_int(name, int(dim.low), int(dim.high), log=dim.log)
        else:
            assert dim.low is not None and dim.high is not None
            params[name] = trial.suggest_float(name, dim.low, dim.high, log=dim.log)
    return params


def space_filling(space: SearchSpace, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` configurations spread evenly over the space, for a study's start: a scrambled Sobol sequence
    (`scipy.stats.qmc`), each coordinate mapped onto its dimension (a log range on the log scale, choices in
    equal shares). The first 2^k points of a Sobol sequence are stratified in every dimension, so 4 points put
    one learning rate in each quarter of its (log) range; 4 random draws leave some quarter empty 9 times in 10,
    and with a handful of trials TPE has nothing to model and draws at random.

    >>> import math
    >>> space = SearchSpace(learning_rate=SearchDim(low=1e-5, high=1e-3, log=True))
    >>> points = space_filling(space, 4, seed=0)
    >>> sorted(int(2 * (math.log10(p["learning_rate"]) + 5)) for p in points)  # the quarter each lies in
    [0, 1, 2, 3]
    >>> {8, 32} <= {p["lora_r"] for p in points}, all(p["lora_alpha_ratio"] in (1.0, 2.0) for p in points)
    (True, True)
    >>> space_filling(space, 4, seed=0) == points, space_filling(space, 0, seed=0)
    (True, [])
    """
    if n <= 0:
        return []
    from scipy.stats import qmc  # seconds to import: only a new study's first trials need it

    active = space.active()
    sobol = qmc.Sobol(d=len(active), scramble=True, seed=seed)
    # a power of two keeps the sequence's balance (scipy warns otherwise); its first n points are taken
    units = sobol.random_base2(m=max(0, math.ceil(math.log2(n))))[:n]
    return [
        {name: _at(u, name, dim) for u, (name, dim) in zip(row.tolist(), active.items(), strict=True)} for row in units
    ]


def _at(u: float, name: str, dim: SearchDim) -> Any:
    """The value at `u` in [0, 1) of one dimension, of the type `suggest` asks the trial for."""
    integer = name in INTEGER
    if dim.choices is not None:
        return _typed(dim.choices[min(int(u * len(dim.choices)), len(dim.choices) - 1)], integer)
    assert dim.low is not None and dim.high is not None  # SearchDim: a range without choices
    low, high = (math.log(dim.low), math.log(dim.high)) if dim.log else (dim.low, dim.high)
    value = low + u * (high - low)
    value = math.exp(value) if dim.log else value
    value = min(max(value, dim.low), dim.high)  # exp(log(x)) may round past a bound
    return round(value) if integer else value  # integer bounds (SearchSpace): the rounded value stays inside


def to_overrides(params: dict[str, Any], lora: dict[str, Any]) -> dict[str, Any]:
    """Config paths and values for a trial's parameters; `lora` (train.lora) gives the rank the alpha ratio
    scales when the trial does not search it.

    >>> to_overrides({"lora_r": 16, "lora_alpha_ratio": 2.0, "learning_rate": 3e-4}, {})
    {'train.lora.r': 16, 'train.grpo.learning_rate': 0.0003, 'train.lora.lora_alpha': 32}
    >>> to_overrides({"lora_alpha_ratio": 2.0}, {"r": 4})
    {'train.lora.lora_alpha': 8}
    """
    overrides = {TARGETS[name]: value for name, value in params.items() if name in TARGETS}
    if "lora_alpha_ratio" in params:
        rank = params.get("lora_r", lora.get("r", DEFAULT_LORA_R))
        overrides[ALPHA] = max(1, round(params["lora_alpha_ratio"] * rank))
    return overrides


def apply_best(cfg: PipelineConfig, best: dict[str, Any]) -> PipelineConfig:
    """A new config with `best` (config path -> value, e.g. `HPOResult.overrides`) applied and validated.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> cfg = apply_best(load_config(None), {"train.lora.r": 32, "train.grpo.learning_rate": 1e-4})
    >>> cfg.train.lora["r"], cfg.train.grpo["learning_rate"]
    (32, 0.0001)
    """
    tree = cfg.model_dump()
    for path, value in best.items():
        set_path(tree, path.split("."), value, f"{path}: ")
    return PipelineConfig.model_validate(tree)


def trial_train(train: TrainConfig, hpo: HPOConfig, overrides: dict[str, Any]) -> TrainConfig:
    """The `train` section of one trial: the overrides (`train.*` paths, `to_overrides`) validated as the whole
    config validates them (the section's own rules, then `hpo.check_against` it), `hpo.steps` steps, a
    validation reward every `hpo.eval_every` steps, no relaunch after a crash (a crashed trial is a result), no
    early stopping (the pruner decides)."""
    tree = train.model_dump()
    for path, value in overrides.items():
        section, _, rest = path.partition(".")
        if section != "train":
            raise ConfigError(f"{path}: a trial sets train.* fields only")
        set_path(tree, rest.split("."), value, f"{path}: ")
    tuned = TrainConfig.model_validate(tree)
    hpo.check_against(tuned)
    grpo = dict(tuned.grpo)
    per_device = grpo_value(grpo, "per_device_train_batch_size")
    grpo |= {
        "max_steps": hpo.steps,
        "eval_strategy": "steps" if rung_checks(hpo) else "no",
        "eval_steps": hpo.eval_every,
        "num_generations_eval": hpo.eval_generations,
        # as many completions per evaluation batch as per training batch, in whole prompt groups
        "per_device_eval_batch_size": max(
            hpo.eval_generations, per_device // hpo.eval_generations * hpo.eval_generations
        ),
    }
    trial = tuned.model_copy(
        update={
            "grpo": grpo,
            "early_stopping_patience": None,
            "max_restarts": 0,
            "cpu_threads": tuned.cpu_threads or threads_per_trial(hpo, tuned),
        }
    )
    facts = LAUNCHERS[trial.launcher]
    if not facts.local:  # the trial task's cheaper GPU list, not the one planned for training
        trial = facts.rents().trial(trial, hpo.trial_task_file)
    return trial


def rung_checks(hpo: HPOConfig) -> bool:
    """Whether a trial's trainer evaluates on the rungs: to prune before the top rung, or to give the trial its
    value (`hpo.trial_score: trainer`). A single rung at the last step of a trial that a scorer ranks would be an
    evaluation nobody reads (4.7 s of a 16-step demo trial's 69 s on 2 cores).

    >>> rung_checks(HPOConfig(steps=16, eval_every=8)), rung_checks(HPOConfig(steps=16, eval_every=16))
    (True, False)
    >>> rung_checks(HPOConfig(steps=16, eval_every=16, trial_score="trainer"))
    True
    """
    return hpo.trial_score == "trainer" or hpo.eval_every < hpo.steps


def threads_per_trial(hpo: HPOConfig, train: TrainConfig) -> int | None:
    """Each local trial's share of this machine's cores when `hpo.concurrency` trials run at once (at least one);
    None (torch's own choice: every core) for one trial at a time or trials on their own nodes. Without it each of
    two trials would size its thread pool to every core, and the two would fight over them.

    >>> import os
    >>> cores = len(os.sched_getaffinity(0))
    >>> threads_per_trial(HPOConfig(concurrency=2), TrainConfig()) == max(1, cores // 2)
    True
    >>> threads_per_trial(HPOConfig(concurrency=1), TrainConfig()), threads_per_trial(
    ...     HPOConfig(concurrency=2), TrainConfig(launcher="sky"))
    (None, None)
    """
    if hpo.concurrency == 1 or not LAUNCHERS[train.launcher].local:
        return None
    return max(1, len(os.sched_getaffinity(0)) // hpo.concurrency)


def fits(params: dict[str, Any], space: SearchSpace) -> bool:
    """Whether earlier parameters lie in this search space (same dimensions, values inside).

    >>> space = SearchSpace(lora_alpha_ratio=None)
    >>> fits({"lora_r": 16, "learning_rate": 2e-4}, space), fits({"lora_r": 12, "learning_rate": 2e-4}, space)
    (True, False)
    """
    active = space.active()
    if set(params) != set(active):
        return False
    return all(_inside(params[name], dim) for name, dim in active.items())


def _inside(value: Any, dim: SearchDim) -> bool:
    if dim.choices is not None:
        return value in dim.choices
    return dim.low <= value <= dim.high
