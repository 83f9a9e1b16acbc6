"""`hpo.*`: the hyperparameter search (`grpo_pipeline.tasks.hpo`): the study's trials, rungs and pruner, its budget,
how trials are scored, and the space searched (`SearchSpace`, one `SearchDim` per hyperparameter)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from grpo_pipeline.configs import library_fields
from grpo_pipeline.configs.base import StrictModel

if TYPE_CHECKING:
    from grpo_pipeline.configs.train import TrainConfig


class SearchDim(StrictModel):
    """One searched hyperparameter: a range (`low`, `high`, `log` for a log scale) or a list of `choices`."""

    low: float | None = None
    high: float | None = None
    log: bool = Field(False, description="sample on a log scale (learning rates: each decade equally likely)")
    choices: list[int | float] | None = None

    @model_validator(mode="after")
    def _one_form(self) -> SearchDim:
        if self.choices is not None:
            if self.low is not None or self.high is not None:
                raise ValueError("give either choices or low/high, not both")
            if not self.choices:
                raise ValueError("choices must not be empty")
            repeated = sorted({c for c in self.choices if [float(d) for d in self.choices].count(float(c)) > 1})
            if repeated:  # TPE would sample a repeated choice more often: a weight nobody meant to give it
                raise ValueError(f"choices repeat {repeated}; list each value once")
            return self
        if self.low is None or self.high is None:
            raise ValueError("give low and high (a range) or choices (a list)")
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-scale range needs low > 0 (got {self.low})")
        return self

    def values(self) -> list[float]:
        """The bounds or choices: every value that must satisfy a hyperparameter's own constraint."""
        if self.choices is not None:
            return list(self.choices)
        assert self.low is not None and self.high is not None  # `_one_form` requires a range without choices
        return [self.low, self.high]


# name -> (must be an integer, smallest allowed value, is that bound exclusive)
SEARCHABLE: dict[str, tuple[bool, float, bool]] = {
    "lora_r": (True, 1, False),
    "lora_alpha_ratio": (False, 0, True),
    "learning_rate": (False, 0, True),
    "beta": (False, 0, False),
    "num_generations": (True, 2, False),
    "temperature": (False, 0, True),
}


class SearchSpace(StrictModel):
    """What the study searches; a dimension left out (null) keeps the training config's value."""

    lora_r: SearchDim | None = Field(
        SearchDim(choices=[8, 16, 32]), description="LoRA rank: more = closer to full fine-tuning"
    )
    lora_alpha_ratio: SearchDim | None = Field(
        SearchDim(choices=[1, 2]),
        description="lora_alpha = ratio x rank: searching the ratio keeps the adapter's scale independent of the rank",
    )
    learning_rate: SearchDim | None = SearchDim(low=1e-5, high=1e-3, log=True)
    beta: SearchDim | None = Field(None, description="KL coefficient; > 0 loads a reference model (more memory)")
    num_generations: SearchDim | None = Field(
        None, description="completions per prompt; each choice must divide the generation batch (same compute per step)"
    )
    temperature: SearchDim | None = Field(
        None, description="sampling temperature; the validation reward is sampled at it too, so lower looks better"
    )

    @field_validator(*SEARCHABLE)
    @classmethod
    def _dim_fits(cls, dim: SearchDim | None, info: ValidationInfo) -> SearchDim | None:
        if dim is None:
            return dim
        assert info.field_name is not None  # a field validator's
        integer, floor, exclusive = SEARCHABLE[info.field_name]
        for value in dim.values():
            if integer and float(value) != int(value):
                raise ValueError(f"{value} is not an integer")
            if value < floor or (exclusive and value == floor):
                raise ValueError(f"{value} is out of range; it must be {'>' if exclusive else '>='} {floor}")
        if info.field_name == "num_generations" and dim.choices is None:
            raise ValueError("give choices (each must divide the generation batch), not a range")
        return dim

    def active(self) -> dict[str, SearchDim]:
        return {name: dim for name in SEARCHABLE if (dim := getattr(self, name)) is not None}


class HPOConfig(StrictModel):
    """Optuna search before training: many short GRPO trials promoted on rungs (successive halving / Hyperband),
    each finished trial scored greedily on fixed validation prompts, the top ones re-scored on fresh prompts, and
    the best applied to `train` only when it beats the configured values beyond the noise."""

    enabled: bool = Field(False, description="run the search before training")
    trials: int = Field(
        8,
        ge=1,
        description="most trials in the study (the step budget may stop it first); a rerun "
        "of the same study only runs what is left",
    )
    concurrency: int = Field(1, ge=1, description="trials at once: local processes, or SkyPilot jobs (one GPU each)")
    steps: int = Field(20, ge=1, description="GRPO steps of a trial that is never pruned (the top rung)")
    eval_every: int = Field(
        5,
        ge=1,
        description="steps between rung checks (sampled validation reward on "
        "rung_prompts); the first rung and each pruning point",
    )
    eval_generations: int = Field(2, ge=1, description="completions per rung prompt per check: fewer = faster, noisier")
    rung_prompts: int = Field(
        16,
        ge=1,
        description="validation prompts of each rung check (the first ones of the "
        "scoring set, the same for every trial)",
    )
    pruner: Literal["hyperband", "successive_halving", "median", "threshold", "none"] = Field(
        "hyperband",
        description="hyperband / successive_halving: rungs from eval_every up to steps, a third of the "
        "trials promoted at each; median: stop a trial below the median of earlier ones at the same step",
    )
    reduction_factor: int = Field(
        3, ge=2, description="hyperband / successive_halving: 1 in this many trials goes on to the next rung"
    )
    min_configurations: int = Field(
        8,
        ge=1,
        description="hyperband / successive_halving: configurations that "
        "must reach the first rung before any goes past it (the first ones stop there)",
    )
    budget_steps: int | None = Field(
        None,
        ge=1,
        description="trial GRPO steps the search may spend in all; default: "
        "budget_fraction of the training run's max_steps",
    )
    budget_fraction: float = Field(
        1.0,
        gt=0,
        description="the search's budget as a share of the training run it "
        "feeds: its steps, and for SkyPilot trials its planned cost in USD",
    )
    trial_score: Literal["greedy", "sampled", "trainer"] = Field(
        "greedy",
        description="greedy: each finished trial's adapter scored greedily on fixed validation prompts "
        "(a known noise, paired; the adapter must be readable where the search runs); sampled: the same prompts "
        "and decision, each prompt scored by the mean of trial_samples seeded samples at evaluate.temperature "
        "(it sees a policy improve before its greedy answers change: short trials); trainer: the trainer's "
        "sampled validation reward at the last rung (no extra pass, noisier, no re-scoring)",
    )
    trial_samples: int = Field(
        4, ge=1, description="trial_score=sampled: completions per validation prompt (more = less sampling noise)"
    )
    target_standard_error: float = Field(
        0.05,
        gt=0,
        description="standard error of a trial's validation score (its skill reward): sizes the prompt sets for the worst-case "
        "per-prompt SD (reward_sd); trial_score=sampled stops a scoring sooner, once the SE measured on the "
        "prompts scored so far (at least min_prompts) reaches it",
    )
    min_prompts: int = Field(
        16,
        ge=2,
        description="trial_score=sampled: the fewest prompts a scoring uses before its measured standard error "
        "may stop it, and the chunk it grows by (a standard deviation from fewer prompts is itself too noisy to "
        "trust); every scorer: the fresh prompts after which the re-scoring of the top trials first looks at its "
        "decision (then each time they double, until it is clear)",
    )
    reward_sd: float | None = Field(
        None,
        gt=0,
        description="per-prompt standard deviation of the skill reward (what a trial is scored by) that sizing "
        "assumes; default: the worst case for a score in [0, 1], 0.5",
    )
    rescore_top_k: int = Field(
        3,
        ge=1,
        description="the best trials re-scored on as many fresh prompts before the best is chosen (no winner's curse)",
    )
    keep_configured: bool = Field(
        True,
        description="run the configured values as a trial (never pruned) and keep "
        "them unless the best beats them beyond the noise",
    )
    pruner_startup_trials: int = Field(2, ge=0, description="median: trials that must finish before any is pruned")
    prune_below: float | None = Field(
        None, description="threshold: stop a trial whose validation reward falls below this"
    )
    storage: str | None = Field(
        None,
        description="Optuna database URL (postgresql+psycopg2://..., for workers on several machines); "
        "default: a journal file under data_dir, locked for parallel trials",
    )
    study_name: str = Field(
        "grpo-hpo-{date}",
        description="{date} = today (UTC): a rerun the same day resumes the study; a new day's study is warm-started",
    )
    warm_start: bool = Field(True, description="enqueue the best trial of each earlier study of the same base model")
    start_trials: int = Field(
        10,
        ge=0,
        description="a new study's first trials (the control and the warm start included) spread over the space "
        "(a scrambled Sobol sequence), not TPE's random start: 4 of them put one learning rate in each quarter of "
        "its range; TPE models the trials after them; 0: TPE from the first",
    )
    seed: int = Field(0, description="seeds the TPE sampler")
    trial_task_file: str | None = Field(
        None,
        description="the task file trials launch with on rented GPUs; None: the launcher's own "
        "(sky: sky/hpo-trial.yaml, cheaper GPUs, no retry after a crash)",
    )
    space: SearchSpace = SearchSpace()

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "sky_task_yaml" in data:
            raise ValueError(
                "sky_task_yaml is now trial_task_file (the task file trials launch with on rented GPUs, for any "
                "launcher): rename it"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> HPOConfig:
        if self.steps % self.eval_every:
            raise ValueError(
                f"steps ({self.steps}) must be a multiple of eval_every ({self.eval_every}): a trial's value is "
                "its validation reward at its last step"
            )
        if self.pruner == "threshold" and self.prune_below is None:
            raise ValueError("pruner 'threshold' needs prune_below (the validation reward a trial must keep)")
        if self.storage and not self.storage.startswith(("sqlite:///", "postgresql", "mysql")):
            raise ValueError(
                f"storage {self.storage!r} is not a database URL: use postgresql+psycopg2://... "
                "(or leave it unset for a journal file under data_dir)"
            )
        if self.storage and self.storage.startswith("sqlite") and self.concurrency > 1:
            raise ValueError(
                "storage: SQLite cannot lock the queued trial parallel workers take, so two of them can run the same "
                "one; leave hpo.storage unset (a journal file with a file lock) or use PostgreSQL"
            )
        try:
            self.study_name.format(date="2000-01-01")
        except (KeyError, IndexError, ValueError):
            raise ValueError(f"study_name {self.study_name!r}: the only placeholder is {{date}}") from None
        if not self.space.active():
            raise ValueError("space: nothing to search; give at least one dimension")
        return self

    def check_against(self, train: TrainConfig) -> None:
        """Cross-stage checks: a trial no longer than the training it tunes (when the search is on); every
        num_generations choice must divide the generation batch."""
        max_steps = train.grpo.get("max_steps")
        if self.enabled and isinstance(max_steps, int) and 0 < max_steps < self.steps:
            raise ValueError(
                f"hpo.steps ({self.steps}) is longer than the training it tunes (train.grpo.max_steps={max_steps}): "
                "a trial would rank configurations at a length the final run never reaches; lower hpo.steps (and "
                "hpo.eval_every with it) or raise train.grpo.max_steps"
            )
        dim = self.space.num_generations
        if dim is None:
            return
        grpo = train.grpo
        batch = grpo.get("generation_batch_size") or library_fields.grpo_value(grpo, "per_device_train_batch_size") * (
            grpo.get("steps_per_generation") or grpo.get("gradient_accumulation_steps", 1)
        )
        bad = [int(v) for v in dim.values() if batch % int(v)]
        if bad:
            raise ValueError(
                f"space.num_generations: {bad} do not divide the generation batch ({batch} completions); "
                "pick divisors, or change train.grpo.per_device_train_batch_size"
            )
