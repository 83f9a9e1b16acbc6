"""What a pipeline run returns: one typed `RunSummary`, the flow's result, what `grpo-pipeline run --json`
prints, what the report renders and what CI reads (its JSON schema: `RunSummary.model_json_schema()`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from grpo_pipeline.tasks.baseline_cache import BaselineResult
from grpo_pipeline.tasks.check import TaskCheck
from grpo_pipeline.tasks.data.drift import Drift
from grpo_pipeline.tasks.evaluate import EvalResult
from grpo_pipeline.tasks.job import WarmStart
from grpo_pipeline.tasks.promote.decide import PromotionDecision, paired_difference, paired_rows
from grpo_pipeline.tasks.promote.serving import BaseRef, ServingCheck
from grpo_pipeline.trainer.spec import TrainResult

if TYPE_CHECKING:  # the search's module loads optuna; the summary is read without it
    from grpo_pipeline.tasks.hpo import HPOResult


class MlflowRef(BaseModel):
    tracking_uri: str
    run_id: str  # the pipeline's parent run; each stage is a nested run under it
    experiment_id: str


class BaseChoice(BaseModel):
    base: str  # as configured, or the selected candidate
    path: str  # what from_pretrained loaded
    quantization: str


class Example(BaseModel):
    """One holdout sample of the candidate, right or wrong by `evaluate.accuracy_reward` (`grpo_pipeline.tasks.evaluate.pick_examples`)."""

    verdict: Literal["right", "wrong"]
    key: str | int
    prompt: str
    answer: Any = None  # the reference, as the data holds it
    completion: str  # its last EXAMPLE_CHARS characters
    scores: dict[str, float]  # each reward and the total


class Holdout(BaseModel):
    """Every model scored on the same holdout prompts, greedy: the task's skill reward (base, trained, gain and
    its paired 95 % interval), the weighted total, each reward's mean, and a few of the candidate's right and
    wrong samples."""

    n: int
    skill: str | None = None  # the skill reward's name (`RewardSet.skill`); None in summaries written before it
    skill_base: float | None = None
    skill_trained: float | None = None
    skill_gain: float | None = None  # trained - base
    skill_ci: tuple[float, float] | None = None  # the gain's paired-bootstrap 95 % interval
    base_reward: float  # the weighted total
    trained_reward: float
    gain: float
    base: dict[str, float]
    trained: dict[str, float]
    champion_reward: float | None = None
    champion: dict[str, float] | None = None
    examples: list[Example] = []
    # whether the baseline's scores were read from the cache (`grpo_pipeline.tasks.baseline_cache`) rather than
    # computed this run; None: the cache was off (evaluate.cache_baseline), or there was no champion
    base_cached: bool | None = None
    champion_cached: bool | None = None

    @classmethod
    def of(cls, base: EvalResult, trained: EvalResult, champion: EvalResult | None, skill: str) -> Holdout:
        cand, paired_base = paired_rows(trained.rows, base.rows)
        gain = paired_difference([r[skill] for r in cand], [r[skill] for r in paired_base], confidence=0.95)
        return cls(
            n=base.n,
            skill=skill,
            skill_base=gain["mean_baseline"],
            skill_trained=gain["mean_candidate"],
            skill_gain=gain["mean_diff"],
            skill_ci=(gain["ci_low"], gain["ci_high"]),
            base_reward=base.reward,
            trained_reward=trained.reward,
            gain=trained.reward - base.reward,
            base=base.per_reward | base.metrics,
            trained=trained.per_reward | trained.metrics,
            champion_reward=champion.reward if champion else None,
            champion=champion.per_reward | champion.metrics if champion else None,
            examples=trained.examples,
            base_cached=_cached(base),
            champion_cached=_cached(champion),
        )

    @property
    def baseline(self) -> dict[str, float]:
        """What the candidate was decided against: the champion, or the base model when there is none."""
        return self.champion or self.base


def _cached(result: EvalResult | None) -> bool | None:
    """Whether a baseline's scores came from the cache; None when the cache was off or it is no baseline's."""
    return result.cached if isinstance(result, BaselineResult) and result.cache_key else None


class Search(BaseModel):
    """The hyperparameter search's outcome, when `hpo.enabled`: what it found, and whether training uses it."""

    study: str
    best_trial: int
    best_value: float  # greedy validation reward on the selection prompts
    overrides: dict[str, Any]  # config path -> value, applied to training ({} when the configured values stay)
    applied: bool | None = None  # False: the best did not beat the configured values beyond the noise; they were kept
    decision: str = ""  # why, with the figures (re-scored means, the paired difference and its 95 % interval)
    best_overrides: dict[str, Any] = {}  # the best trial's values, applied or not
    difference: float | None = None  # best - configured on fresh validation prompts
    difference_ci: tuple[float, float] | None = None
    steps_spent: int = 0  # trial GRPO steps
    budget_steps: int | None = None

    @classmethod
    def of(cls, result: HPOResult) -> Search:
        """From `grpo_pipeline.tasks.hpo.HPOResult`."""
        return cls(
            study=result.study_name,
            best_trial=result.best_trial,
            best_value=result.best_value,
            overrides=result.overrides,
            applied=result.applied,
            decision=result.decision,
            best_overrides=result.best_overrides,
            difference=result.difference,
            difference_ci=result.difference_ci,
            steps_spent=result.steps_spent,
            budget_steps=result.budget_steps,
        )


class Cost(BaseModel):
    cost_usd_estimated: float
    cost_usd_actual: float


class MonthCost(BaseModel):
    """The real month against the planner's projection of retraining daily: every pipeline run's actual cost
    this calendar month (UTC), this one included, from the experiment's parent runs."""

    month: str  # YYYY-MM
    actual_usd: float
    runs: int  # runs that trained this month
    projected_usd: float | None  # the plan's monthly cost of a run a day (None: plan.daily_projection off)


class Merged(BaseModel):
    merged_dir: str
    max_logit_difference: float
    dtype: str
    source: str  # the merged MLflow model's URI (models:/m-...)
    model_id: str  # the logged model
    run_id: str  # the merge run, which logged it


class _Versions(BaseModel):
    model_config = ConfigDict(coerce_numbers_to_str=True)  # MLflow hands versions back as int or str


class AliasChange(_Versions):
    model: str  # the registered model (the adapter's, or its merged companion)
    alias: str
    version: str | None  # None: the alias was removed
    before: str | None  # the version it pointed at


class Registered(_Versions):
    """The candidate's model versions, before any alias moves."""

    model: str
    version: str
    model_uri: str  # the logged MLflow model the version holds
    base: BaseRef  # what its adapter_config.json names
    merged_model: str | None = None
    merged_version: str | None = None

    @property
    def uri(self) -> str:
        """How anyone loads it: `mlflow.pyfunc.load_model(uri)`."""
        return f"models:/{self.model}/{self.version}"


class RegistryOutcome(_Versions):
    model: str
    candidate_version: str
    decided_against: str | None  # the champion's version, or None: the base model was the baseline
    moves: list[AliasChange]
    aliases: dict[str, str | None]
    base_model: str  # the base as anyone loads it: a hub id, or runs:/<id>/model
    serving_check: ServingCheck
    merged_model: str | None = None
    merged_version: str | None = None
    merged_aliases: dict[str, str | None] | None = None


class TrainRows(BaseModel):
    """The rows the run trained on, against what its parent adapter's lineage had seen (`data.incremental`)."""

    incremental: bool
    new: int  # train rows no earlier champion of the lineage trained on
    replayed: int  # seen rows trained on again (data.replay_fraction of them, when incremental)
    seen_before: int  # train rows of this dataset the parent's lineage had trained on
    lineage_known: bool = True  # False: the parent recorded no keys (registered before this was kept); all are new
    # holdout rows the parent was not judged on: new rows whose key lands them in the holdout (split by key, never
    # moved into training); None when the parent recorded no holdout
    new_holdout: int | None = None


class RunSummary(BaseModel):
    """`status` "completed": every stage ran. "skipped" (`data.skip_unchanged`): the champion was trained on these
    rows with this configuration, so the run ended after the data stage with `skipped_reason`; nothing trained,
    and the training, evaluation and registry fields are empty."""

    status: Literal["completed", "skipped"] = "completed"
    skipped_reason: str | None = None
    mlflow: MlflowRef
    run_dir: str
    data: dict[str, Any]  # the dataset's fingerprint and the data stage's report
    model: BaseChoice
    warm_start: WarmStart | None = None  # the adapter training continued (model.init_adapter), None: from the base
    # why a run asked to continue the champion trained from the base (model.init_adapter=champion_or_base and no
    # champion yet: a schedule's first day); None when it continued one or was asked for none
    cold_start: str | None = None
    # can GRPO learn it: the base's sampled accuracy, its mixed groups, the verdict (check.enabled; None: not run)
    task_check: TaskCheck | None = None
    rows: TrainRows | None = None  # what was trained on: new and replayed rows
    # today's new rows against the champion's (prompt length, answer type, its reward on them against its holdout),
    # .alert when that reward fell past data.drift_alert; .skipped_reason when nothing was measured (no champion)
    drift: Drift | None = None
    config_hash: str | None = (
        None  # the configuration as it decides what trains (grpo_pipeline.tasks.data.stage.config_hash)
    )
    # train.rewards said `auto`: the skill reward the task's answers chose, and why (tasks/data/shape.py)
    skill_choice: dict[str, str] | None = None
    holdout: Holdout | None = None
    train: TrainResult | None = None  # with .health (every rule that fired: rule, step, value, threshold, action,
    # taken), .stopped_by (the health stop, if one ended training) and .rollbacks
    plan: dict[str, Any] | None = None  # the planner's flat figures (GPU, memory, hours, USD)
    hpo: Search | None = None
    cost: Cost | None = None
    month: MonthCost | None = None  # the month's actual cost so far, against the plan's projection
    merge: Merged | None = None
    decision: PromotionDecision | None = None
    registry: RegistryOutcome | None = None
    # wall seconds by stage, in the order they ran (data, model, task-check, plan, hpo, evaluate-base, train, ...,
    # promote): where a run's time went; the report and the process start-up are outside it
    timings: dict[str, float] = {}
