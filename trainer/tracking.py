"""MLflow logging that survives preemption: each step's metrics are logged exactly once.

HF's own MLflow callback logs every step as it happens, so the steps between the last checkpoint and a
preemption are logged twice (once before the kill, again when recomputed). Here a step's metrics travel
with the checkpoint that covers it: they are written into the checkpoint (`metrics.json`) and logged to
MLflow once the checkpoint is complete, skipping any step MLflow already has. Work lost to a preemption
was never logged, and a checkpoint whose metrics did not reach MLflow before a kill logs them on resume.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from grpo_pipeline.trainer.checkpoints import METRICS_FILE

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

STEP_KEY = "global_step"  # logged with every step: its latest value is the last step MLflow holds


def numeric(logs: dict) -> dict[str, float]:
    """The loggable part of an HF log dict.

    >>> numeric({"loss": 0.5, "note": "x", "flag": True, "nan": float("nan")})
    {'loss': 0.5}
    """
    return {
        k: float(v)
        for k, v in logs.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class CommittedMetrics(TrainerCallback):
    def __init__(self, tracking_uri: str, run_id: str):
        from mlflow import MlflowClient

        self.client, self.run_id = MlflowClient(tracking_uri), run_id
        self._pending: list[tuple[int, dict[str, float]]] = []
        self._lock = threading.Lock()
        # (step, key) pairs this process has logged: HF's final summary log carries the last step's number
        # and its `epoch` again, and the step's own entry came with the last checkpoint.
        self._logged: set[tuple[int, str]] = set()
        run = self.client.get_run(run_id)
        # Steps MLflow held when this process started; this process commits each of its entries once.
        self.skip_through = int(run.data.metrics.get(STEP_KEY, 0))
        self._has_params = bool(run.data.params)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._has_params:  # a resumed job: the run already holds them, and MLflow refuses changes
            return
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in sorted(args.to_dict().items())]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self._has_params = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        values = numeric(logs or {})
        if values:
            with self._lock:
                self._pending.append((state.global_step, values))

    def take(self, through_step: float = math.inf) -> list[tuple[int, dict[str, float]]]:
        """Remove and return the pending entries up to a step (those a checkpoint at that step covers)."""
        with self._lock:
            taken = [e for e in self._pending if e[0] <= through_step]
            self._pending = [e for e in self._pending if e[0] > through_step]
        return taken

    @staticmethod
    def write(entries: list, directory: Path) -> None:
        (directory / METRICS_FILE).write_text(json.dumps(entries))

    @staticmethod
    def read(directory: Path) -> list[tuple[int, dict[str, float]]]:
        path = directory / METRICS_FILE
        return [(int(s), m) for s, m in json.loads(path.read_text())] if path.is_file() else []

    def commit(self, entries: list[tuple[int, dict[str, float]]]) -> None:
        """Log entries past the steps MLflow held at start (a recovered checkpoint's are skipped if logged),
        each key once per step."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        with self._lock:
            for step, values in entries:
                if step <= self.skip_through:
                    continue
                for k, v in {**values, STEP_KEY: float(step)}.items():
                    if (step, k) not in self._logged:  # each key once per step; the first value stands
                        self._logged.add((step, k))
                        metrics.append(Metric(k, v, now, step))
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
