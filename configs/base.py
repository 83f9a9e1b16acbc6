"""What every section of the configuration is built on: `StrictModel`, whose typo is an error and not a silently
ignored key, and `close_match`, the "did you mean" of the messages that name a field (pure pydantic, no I/O).

`grpo_pipeline.configs.schema` composes the sections (`configs/data.py`, `model.py`, `plan.py`, `train.py`, `hpo.py`,
`evaluate.py`, `merge.py`, `promote.py`, `tracking.py`, `deploy.py`, `ab.py`) into `PipelineConfig`; a section never
imports the schema. This module imports nothing of the project, so the trainer may import it (its job spec's
models are `StrictModel`s) and so may the sections its job spec carries (`trainer_fields.py`, `layout.py`,
`health.py`, `sampling.py`, `rewards.py`), which import nothing else of the project, so a node runs them alone.
"""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def close_match(name: str, allowed: typing.Iterable[str]) -> str:
    """The "did you mean" a message adds for a name that is not among `allowed` (empty when none is close).

    >>> close_match("max_step", ["max_steps", "beta"]), close_match("zzz", ["beta"])
    ("; did you mean 'max_steps'?", '')
    """
    match = difflib.get_close_matches(name, list(allowed), n=1)
    return f"; did you mean '{match[0]}'?" if match else ""
