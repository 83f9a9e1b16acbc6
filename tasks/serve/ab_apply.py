"""One round of the live A/B, as `grpo-pipeline ab decide` and the `ab-decide` flow (flows/ab.py) both run it:

1. `decide_round`: read the aliases, the requests the *current* champion and challenger versions answered (the
   log is per version: a challenger replaced by a newer candidate under `promote.mode=canary` no longer
   counts, so its test restarts), and decide with the pure `grpo_pipeline.tasks.serve.ab.decide`;
2. `settle_round`: for `promote` or `rollback`, move the aliases under the registry lock
   (`grpo_pipeline.tasks.serve.ab.settle`), unless they moved since step 1 (`AliasesMoved`: nothing moves).

Two steps so a caller can report the decision when the move fails; one implementation of each.
"""

from __future__ import annotations

from pydantic import BaseModel

from grpo_pipeline.configs.ab import ABConfig
from grpo_pipeline.tasks.promote.registry import CHALLENGER, CHAMPION, Registry
from grpo_pipeline.tasks.serve.ab import ABDecision, decide, settle
from grpo_pipeline.tasks.serve.ab_log import RequestLog

NO_TEST = "no challenger alias: no test is running"
# A fresh registry (no pipeline run has registered a version yet): what the hourly schedule says until one has.
NOTHING_YET = (
    "nothing to decide yet: the registry holds no champion and no challenger; a pipeline run that registers a "
    "version makes the first champion"
)
OFFLINE = (
    "promote.mode is offline: the challenger alias holds the candidate the offline gate rejected, which is "
    "never served nor tested live; set promote.mode=canary for a live test"
)
# The rule for a candidate that arrives while a test runs (promote.mode=canary), said wherever a decision is shown.
REPLACEMENT_RULE = (
    "a newer candidate that passes the offline gate replaces the challenger and the test restarts: "
    "only the requests the current challenger version answered count"
)


class Round(BaseModel):
    """What one round found and did. `decision` is None when no challenger alias exists (nothing to decide)."""

    champion: str | None
    challenger: str | None
    decision: ABDecision | None = None
    reasons: list[str] = []  # why there is no decision
    moves: list[str] = []  # the alias moves made, as `model@alias: before -> after`
    applied: bool = False  # settle_round ran (not a dry run)

    def decided(self) -> tuple[ABDecision, str]:
        """The decision and the challenger version it is about; a round that decided nothing (no challenger,
        `promote.mode: offline`) raises ValueError, as there is nothing to settle or report."""
        if self.decision is None or self.challenger is None:
            raise ValueError(
                f"this A/B round has no decision ({'; '.join(self.reasons) or 'no challenger'}); "
                "only a round with a decision can be settled or reported"
            )
        return self.decision, self.challenger

    @property
    def action(self) -> str | None:
        return self.decision.action if self.decision else None

    def as_json(self) -> dict:
        """The object `grpo-pipeline ab decide --json` prints (and the flow returns)."""
        if self.decision is None:
            return {
                "status": "ok",
                "action": None,
                "champion": self.champion,
                "challenger": self.challenger,
                "reasons": self.reasons,
            }
        return {
            "status": "ok",
            **self.decision.model_dump(mode="json"),
            "champion": self.champion,
            "challenger": self.challenger,
            "moves": self.moves,
        }


def decide_round(ab: ABConfig, log: RequestLog, registry: Registry, canary: bool = True) -> Round:
    """The decision on the running test (nothing moves). A champion-less challenger is compared with nothing
    (no champion requests): it continues until `ab.max_duration_h`, then stops. Without `canary`
    (`promote.mode: offline`) no test runs: there `challenger` is the offline gate's reject. No challenger alias
    (a fresh registry included) is said plainly before the mode: there is nothing to decide either way."""
    aliases = registry.aliases()
    champion, challenger = aliases[CHAMPION], aliases[CHALLENGER]
    if not challenger:
        return Round(champion=champion, challenger=None, reasons=[NO_TEST if champion else NOTHING_YET])
    if not canary:
        return Round(champion=champion, challenger=None, reasons=[OFFLINE])
    a, b, hours = log.samples(champion, challenger)
    return Round(champion=champion, challenger=challenger, decision=decide(a, b, ab, hours))


def settle_round(registry: Registry, found: Round) -> Round:
    """Move the aliases the round's decision calls for, under the registry lock; raises `AliasesMoved`
    (`grpo_pipeline.tasks.serve.ab`) when the champion or challenger changed since `decide_round` read them."""
    if found.decision is None:
        return found.model_copy(update={"applied": True})
    decision, challenger = found.decided()
    moves = settle(registry, decision, found.champion, challenger)
    return found.model_copy(update={"moves": [m.describe() for m in moves], "applied": True})
