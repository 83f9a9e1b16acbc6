"""The shape of a task's answers, and the skill reward that can judge them, decided before any work.

A `train.rewards` entry named `auto` is the skill reward chosen from the source's own answers (`choose_skill`, on
up to `SAMPLE_ROWS` rows read from its start): integers -> `correct_answer`; other numbers -> `math_answer`; JSON
objects -> `json_fields`; rows with `tests` -> `code_tests`; a handful of distinct short answers, each repeated, or
a `labels` column -> `label`; any other text -> `exact_match`. A named skill reward is checked against the same
answers: one that scores most of the references themselves 0 cannot judge the task, and the run is refused
(exit 2) naming a reward that could (`task_rewards`). The run's summary says which reward was chosen and why.

    cfg = task_rewards(load_config("configs/demo-cpu.yaml", ["data.source=rows.jsonl"]))
    cfg.train.reward_set().skill   # 'label', say; its entry's `chosen_by` says why
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from itertools import islice
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from grpo_pipeline.configs.evaluate import EvalConfig
from grpo_pipeline.configs.rewards import AUTO, RewardEntry
from grpo_pipeline.configs.schema import ConfigError, DataConfig, PipelineConfig

SAMPLE_ROWS = 10_000  # answers read from the source's start to choose or check the skill reward
MOSTLY = 0.95  # the share of sampled answers that must have a shape for the task to have it (the rest: quarantine)
MAX_LABELS = 20  # more distinct answers than this is text, not a label set
LABEL_REPEATS = 5  # each label seen this many times on average in the sample: a set, not free text that repeats
LABEL_WORDS = 4  # a label is a few words ("not spam"), not a sentence

NUMERIC_SKILLS = frozenset({"correct_answer", "math_answer"})  # whose answers a "just the number" format fits

_INTEGER = re.compile(r"[-+]?\d+")
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")


class SkillChoice(BaseModel):
    """The skill reward `auto` became: its name, its arguments and why, in words the run's summary shows."""

    model_config = ConfigDict(frozen=True)

    reward: str
    args: dict[str, Any] = {}
    why: str


def _json_object(answer: Any) -> bool:
    if isinstance(answer, dict):
        return True
    if not isinstance(answer, str) or not answer.lstrip().startswith("{"):
        return False
    try:
        return isinstance(json.loads(answer), dict)
    except ValueError:
        return False


def _share(answers: Sequence[Any], test: Any) -> float:
    return sum(1 for a in answers if test(a)) / len(answers)


def choose_skill(answers: Sequence[Any], columns: Sequence[str] = ()) -> SkillChoice:
    """The skill reward that can judge these answers (a sample of the task's, as the source holds them: text,
    numbers or JSON objects), and why; `columns` are the other columns the rows have (under the rewards' names).

    >>> choose_skill(["12", "7", 40]).reward, choose_skill(["0.5", "3/4", "2"]).reward
    ('correct_answer', 'math_answer')
    >>> c = choose_skill(["positive", "negative"] * 10)
    >>> c.reward, c.args, c.why
    ('label', {'labels': ['negative', 'positive']}, '2 distinct short answers over 20 sampled rows (negative, positive): a label set')
    >>> choose_skill([{"name": "Ann", "age": 34}, '{"name": "Bo", "age": 5}']).reward
    'json_fields'
    >>> choose_skill(["Paris", "the Nile", "forty-two"]).reward, choose_skill(["x"], ["tests"]).reward
    ('exact_match', 'code_tests')
    """
    n = len(answers)
    if "tests" in columns:
        return SkillChoice(reward="code_tests", why="the rows have a `tests` column: code run against its tests")
    if not n:
        raise ValueError("no answers to choose a skill reward from")
    text = [str(a).strip() for a in answers if not isinstance(a, dict | list)]
    if _share(answers, _json_object) >= MOSTLY:
        return SkillChoice(reward="json_fields", why=f"{n} sampled answers are JSON objects: their fields compared")
    # shares of all the answers: a few of another kind (an object among numbers) are the quarantine's, not the task's
    if sum(1 for a in text if _INTEGER.fullmatch(a)) / n >= MOSTLY:
        return SkillChoice(reward="correct_answer", why=f"{n} sampled answers are integers: the final number compared")
    if sum(1 for a in text if _NUMBER.fullmatch(a.replace(",", ""))) / n >= MOSTLY:
        return SkillChoice(reward="math_answer", why=f"{n} sampled answers are numbers: compared numerically")
    if "labels" in columns:
        return SkillChoice(reward="label", why="the rows have a `labels` column: one of each row's labels named")
    counts = Counter(text)
    short = all(len(a.split()) <= LABEL_WORDS for a in counts)
    if len(text) == n and short and 2 <= len(counts) <= MAX_LABELS and n >= LABEL_REPEATS * len(counts):
        labels = sorted(counts)
        return SkillChoice(
            reward="label",
            args={"labels": labels},
            why=f"{len(labels)} distinct short answers over {n} sampled rows ({', '.join(labels)}): a label set",
        )
    return SkillChoice(
        reward="exact_match",
        why=f"{n} sampled answers are text ({len(counts)} distinct): the final answer compared, case and "
        "punctuation aside",
    )


def sample_answers(cfg: DataConfig, limit: int = SAMPLE_ROWS) -> tuple[list[Any], list[str]]:
    """Up to `limit` answers from the start of `cfg.source`, as the source holds them after the configured
    extraction (`data.answer_extraction`), and the other columns the rows have, under the rewards' names."""
    from grpo_pipeline.tasks.data.checks import extract_answers
    from grpo_pipeline.tasks.data.sources import iter_source

    assert cfg.source is not None  # the demo's answers are integers: no sample needed
    answers: list[Any] = []
    seen: set[str] = set()
    for raw in islice(
        iter_source(
            cfg.source,
            cfg.source_format,
            min(cfg.batch_rows, limit),
            split=cfg.source_split,
            config=cfg.source_config,
            s3_endpoint_url=cfg.s3_endpoint_url,
        ),
        max(1, limit // 64),  # a source of many small files stops here too
    ):
        records = raw.records if raw.records is not None else raw.table.to_pylist() if raw.table is not None else []
        for rec in records:
            if isinstance(rec, dict) and rec.get(cfg.answer_column) is not None:
                answers.append(rec[cfg.answer_column])
                seen.update(rec)
        if len(answers) >= limit:
            break
    answers = answers[:limit]
    if cfg.answer_extraction != "none":
        extracted = extract_answers(pa.array([str(a) for a in answers], pa.string()), cfg).to_pylist()
        answers = [a for a in extracted if a is not None]
    renamed = {source: name for name, source in cfg.columns.items()}
    return answers, sorted(renamed.get(c, c) for c in seen)


def task_rewards(cfg: PipelineConfig) -> PipelineConfig:
    """The configuration with `auto` replaced by the skill reward the source's answers need (its entry says why
    in `chosen_by`), or, when the skill reward is named, checked against those answers: a skill that scores more
    than `data.max_dropped_fraction` of the sampled references themselves 0 cannot judge the task, and the run is
    refused before any work (ConfigError: exit 2) naming the reward and one that could. The demo (no source) is
    resolved by the configuration itself (`PipelineConfig`)."""
    if cfg.data.source is None:
        return cfg
    entries = cfg.train.rewards
    auto = next((e for e in entries if e.name == AUTO), None)
    try:
        answers, columns = sample_answers(cfg.data)
    except (OSError, ValueError) as exc:  # the data stage reports an unreadable source in full
        if auto is None:
            return cfg
        raise ConfigError(f"train.rewards: '{AUTO}' reads the source's answers, which failed: {exc}") from None
    if not answers:
        if auto is None:
            return cfg
        raise ConfigError(
            f"train.rewards: '{AUTO}' chooses the skill reward from the source's answers, and {cfg.data.source} "
            f"has none in its first {SAMPLE_ROWS} rows under data.answer_column={cfg.data.answer_column!r}: map "
            "the column that holds them (data.answer_column) or name the skill reward"
        )
    choice = choose_skill(answers, columns)
    if auto is not None:
        chosen = RewardEntry(
            name=choice.reward,
            weight=auto.weight,
            args={**choice.args, **auto.args},
            role="skill",
            chosen_by=choice.why,
        )
        train = cfg.train.model_copy(update={"rewards": [chosen if e is auto else e for e in entries]})
        cfg = cfg.model_copy(update={"train": train})
    else:
        _check_skill(cfg, answers, columns, choice)
    return cfg.model_copy(update={"evaluate": reported(cfg)})


def reported(cfg: PipelineConfig) -> EvalConfig:
    """The evaluation's accuracy and format columns for the task, where the configuration leaves them at their
    defaults (the demo's `correct_answer` and `number_only`): the accuracy is the skill reward's, and a format of
    "just the number" is reported only for a task whose answers are numbers.

    >>> from grpo_pipeline.configs.schema import load_config
    >>> e = reported(load_config(None, ["train.rewards=[{name: label, args: {labels: [a, b]}}]"]))
    >>> e.accuracy_reward, e.format_reward
    ('label', None)
    """
    given = cfg.evaluate.model_fields_set
    skill = cfg.train.reward_set().skill
    update: dict[str, Any] = {}
    if "accuracy_reward" not in given:
        update["accuracy_reward"] = skill
    if "format_reward" not in given and skill not in NUMERIC_SKILLS:
        update["format_reward"] = None
    return cfg.evaluate.model_copy(update=update)


def _check_skill(cfg: PipelineConfig, answers: list[Any], columns: list[str], choice: SkillChoice) -> None:
    """Refuse a named skill reward that scores most of the sampled references themselves 0."""
    from grpo_pipeline.tasks.data.rows import answer_text
    from grpo_pipeline.trainer.rewards import describe, resolve_reward

    rewards = cfg.train.reward_set()
    skill = rewards.skill
    needs = describe(skill)["columns"]
    if needs != ["answer"]:  # a custom grader of other columns, a service, a model: the data stage checks rows
        return
    references = sorted({answer_text(a) for a in answers})
    try:
        fn = resolve_reward(skill, rewards.args_for(skill))
        scores = fn([[{"role": "assistant", "content": r}] for r in references], answer=references)
    except Exception:  # a bad argument (preflight names the field) or a reward that breaks (the data stage the rows)
        return
    unjudged = [r for r, s in zip(references, scores, strict=True) if not s > 0]
    if len(unjudged) / len(references) <= cfg.data.max_dropped_fraction:
        return
    suggestion = choice.reward + (
        f", args: {{labels: [{', '.join(choice.args['labels'])}]}}" if "labels" in choice.args else ""
    )
    raise ConfigError(
        f"train.rewards: the skill reward '{skill}' cannot judge this task's answers: it scores "
        f"{len(unjudged)} of {len(references)} distinct sampled reference answers themselves 0 (e.g. "
        f"{unjudged[0][:60]!r}). {choice.reward} could ({choice.why}): --set 'train.rewards=[{{name: {suggestion}}}]'"
        f", or let the run choose: --set 'train.rewards=[{AUTO}]'"
    )
