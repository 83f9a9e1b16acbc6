"""The one GRPO trainer a job runs: TRL's GRPOTrainer, with the step's cuts composed in one place.

Each cut is a named piece in its own module, with its own switch (`grpo_pipeline.trainer.cuts`) and its own fallback
(TRL's path). `StepTrainer` overrides each TRL method a cut touches once, here, and calls the pieces in this order:

| TRL's method (private but the first)  | the pieces, in the order they run                                   |
| ------------------------------------- | ------------------------------------------------------------------- |
| `train`                               | compact LM head around the whole run (`lm_head.CompactLMHead`)      |
| `_get_train_sampler`                  | curriculum's sampler, else TRL's (`sampling.CurriculumCut`)         |
| `_generate_and_score_completions`     | dynamic sampling, in training (`dynamic_sampling.DynamicSampling`)  |
| `_generate_single_turn`               | merged generation outside, prefill once inside, then TRL's          |
|                                       | (`generation.MergedGeneration`, `generation.PrefillOnce`)           |
| `_calculate_rewards`                  | TRL's, then the curriculum observes, then dynamic sampling records |
| `_get_per_token_logps_and_entropies`  | shared prompt forward (`shared_prompt.SharedPromptForward`)         |
| `compute_loss`                        | zero-advantage skip (`zero_advantage.ZeroAdvantageSkip`)            |
| `_save_checkpoint`                    | TRL's, then the curriculum's state (`sampling.CurriculumCut`)       |

The order matters in two rows only, and is stated there: the merged weights must be in place when the prefill runs
its forward, and the curriculum's verdicts and dynamic sampling's choice read the same rewards. A cut that is off
leaves its row to TRL. Every TRL method named here, its signature and the behaviour a cut assumes of it are checked
by tests/integration/test_trl_contracts.py, so a TRL upgrade names what broke.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from trl import GRPOTrainer

from grpo_pipeline.trainer.cuts import Cuts
from grpo_pipeline.trainer.dynamic_sampling import DynamicSampling
from grpo_pipeline.trainer.generation import MergedGeneration, PrefillOnce
from grpo_pipeline.trainer.lm_head import CompactLMHead
from grpo_pipeline.trainer.sampling import Curriculum, CurriculumCut
from grpo_pipeline.trainer.shared_prompt import SharedPromptForward
from grpo_pipeline.trainer.zero_advantage import ZeroAdvantageSkip


class StepTrainer(GRPOTrainer):
    """GRPOTrainer running `cuts` (`Cuts()`: none, TRL's step as it ships). `curriculum_state`: the curriculum's
    state from the checkpoint a run resumes from (its `curriculum.json`, `checkpoints.read_checkpoint_json`).
    `skill`: the reward that says whether the task was done (dynamic sampling prefers the groups where it differs)."""

    def __init__(
        self, *args: Any, cuts: Cuts, curriculum_state: dict | None = None, skill: str | None = None, **kwargs: Any
    ) -> None:
        self.cuts = cuts
        self._lm_head = CompactLMHead(cuts.compact_lm_head)
        # outermost first: the prefill's forward runs on the merged weights
        self._generation = (
            MergedGeneration(cuts.merged_generation, torch.cuda.is_available()),
            PrefillOnce(cuts.prefill_once),
        )
        self._shared_prompt = SharedPromptForward(cuts.share_prompt_forward)
        self._zero_advantage = ZeroAdvantageSkip(cuts.skip_zero_advantage)
        super().__init__(*args, **kwargs)
        # these two read the trainer's data and batch shape
        self._curriculum = CurriculumCut(self, cuts.curriculum, curriculum_state) if cuts.curriculum else None
        self._dynamic = DynamicSampling(self, cuts.dynamic_sampling, skill) if cuts.dynamic_sampling else None

    @property
    def curriculum(self) -> Curriculum | None:
        """The curriculum's state (its figures go into the run's result), or None when it is off."""
        return self._curriculum.curriculum if self._curriculum else None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with self._lm_head.around():
            return super().train(*args, **kwargs)

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        if self._curriculum:
            return self._curriculum.sampler(self)
        return super()._get_train_sampler(dataset)

    def _generate_and_score_completions(self, inputs: Any) -> Any:
        if self._dynamic:
            return self._dynamic.generate_and_score(self, super()._generate_and_score_completions, inputs)
        return super()._generate_and_score_completions(inputs)

    def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
        with ExitStack() as around:
            for cut in self._generation:
                around.enter_context(cut.around(self))
            return super()._generate_single_turn(*args, **kwargs)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Any:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._curriculum:
            self._curriculum.observe(self, inputs, rewards_per_func)
        if self._dynamic:
            self._dynamic.record(rewards_per_func)
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        return self._shared_prompt.per_token_logps(self, super()._get_per_token_logps_and_entropies, *args, **kwargs)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return self._zero_advantage.compute_loss(self, super().compute_loss, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self._curriculum:
            self._curriculum.save(self)
