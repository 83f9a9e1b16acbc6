"""Benchmark: what the hyperparameter search buys, at equal total compute.

On the demo task (SmolLM2-135M, configs/demo-cpu.yaml), two sides get the same budget of GRPO steps
(`--budget`, the demo's 40 by default; same completions per step, same completion length):

- **defaults**: every searched hyperparameter at TRL's `GRPOConfig` / PEFT's `LoraConfig` default
  (learning rate, KL beta, temperature, completions per prompt, LoRA rank and alpha), `--budget` steps;
- **searched**: the same starting point, then the search (`tasks.hpo.search`: the demo config's `hpo`
  section, `--trials` trials of `hpo.steps` steps) spends part of the budget, and training with the best
  parameters gets what is left.

Both adapters and the base model are scored greedily on the same holdout. Reported: each side's gain in
holdout reward over the base model, and their ratio (goal >= 1.5). The search's validation evaluations
are generation the defaults side does not do; they are reported as search seconds.

    python -m bench.hpo_gain [--budget 40] [--trials 3] [--work DIR] [--tiny]

The two final trainings run at once. With `--work DIR` every phase keeps its output there and a rerun
picks up where the last one stopped: the base model's score is reused, the stored study has no budget
left, and each trainer resumes from its last checkpoint (or reports its finished adapter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench.harness import RESULTS, ROOT



# Config path -> (library class, field): the hyperparameters the search may set, and their library defaults.
LIBRARY_DEFAULTS = {
    "train.grpo.learning_rate": ("trl.GRPOConfig", "learning_rate"),
    "train.grpo.beta": ("trl.GRPOConfig", "beta"),
    "train.grpo.temperature": ("trl.GRPOConfig", "temperature"),
    "train.grpo.num_generations": ("trl.GRPOConfig", "num_generations"),
    "train.lora.r": ("peft.LoraConfig", "r"),
    "train.lora.lora_alpha": ("peft.LoraConfig", "lora_alpha"),
}


def library_defaults() -> dict[str, object]:
    """The defaults, read from the libraries' own dataclasses (nothing copied by hand)."""
    found = {}
    for path, (cls_path, name) in LIBRARY_DEFAULTS.items():
        module, _, cls_name = cls_path.rpartition(".")
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        found[path] = next(f.default for f in dataclasses.fields(cls) if f.name == name)
    return found


def gain_ratio(searched_gain: float, default_gain: float) -> float | None:
    """Searched gain over default gain; None when the defaults gained nothing (no ratio to speak of).

    >>> gain_ratio(1.5, 0.5), gain_ratio(1.2, 0.0)
    (3.0, None)
    """
    return searched_gain / default_gain if default_gain > 0 else None


def _train(cfg, model: str, splits, run_dir: Path):
    from infra.launch.local import LocalLauncher
    from tasks.job import build_job_spec

    spec = build_job_spec(cfg.train, cfg.model, model, splits, run_dir)
    launcher = LocalLauncher(0, on_line=lambda line: None)
    return launcher.wait(launcher.launch(spec))


def _base_eval(work: Path, model: str, cfg, splits):
    from tasks.evaluate import EvalResult, evaluate_model

    cached = work / "base_eval.json"
    if cached.is_file():
        return EvalResult.model_validate_json(cached.read_text())
    result = evaluate_model(model, cfg.model, splits["holdout"], cfg.train.rewards, cfg.evaluate)
    cached.write_text(result.model_dump_json())
    return result


def _trial_steps(run_dir: Path, trial) -> int:
    """Steps a trial actually trained: its result file (a pruned trial finishes the step it was in)."""
    found = list((run_dir / "hpo").glob(f"*-trial-{trial.number:03d}/train/result.json"))
    if found:
        return json.loads(found[0].read_text())["global_step"]
    return 0  # crashed before reporting: it trained nothing that counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=None, help="GRPO steps per side; default: the demo's max_steps")
    parser.add_argument("--trials", type=int, default=None, help="search trials; default: the demo config's hpo.trials")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model and tiny sizes: a quick check that it runs")
    parser.add_argument("--work", type=Path, default=None, help="keep every phase here; a rerun resumes (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from configs.schema import load_config
    from functools import partial

    from flows.runs import setup_tracking
    from infra.launch import make_launcher
    from tasks.demo_task import generate
    from tasks.splits import write_splits
    from tasks.evaluate import evaluate_model
    from tasks.hpo import Tracking, apply_best, run_trial, search
    from tasks.model import ensure_demo_model
    from tests.tiny_model import create_random_model

    work = (args.work or Path(tempfile.mkdtemp(prefix="bench-hpo-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    overrides = [f"hpo.storage=sqlite:///{work / 'optuna.db'}", f"tracking.mlflow_tracking_uri=sqlite:///{work / 'mlflow.db'}",
                 "hpo.enabled=true", "hpo.warm_start=false", "hpo.study_name=bench-hpo-gain"]
    if args.tiny:
        overrides += ["data.demo.n_train=64", "data.demo.n_val=4", "data.demo.n_holdout=8", "train.grpo.max_steps=8",
                      "train.grpo.max_completion_length=6", "hpo.steps=2", "hpo.eval_every=1", "evaluate.max_new_tokens=6"]
    if args.trials:
        overrides.append(f"hpo.trials={args.trials}")
    demo = load_config(ROOT / "configs" / "demo-cpu.yaml", overrides)
    budget = args.budget or demo.train.grpo["max_steps"]
    tiny = work / "tiny"
    model = str((tiny if (tiny / "config.json").is_file() else create_random_model(tiny)) if args.tiny
                else ensure_demo_model(demo.data_dir / "models"))
    splits = write_splits(generate(demo.data.demo), work / "data")
    defaults = library_defaults()
    start = apply_best(demo, defaults | {"train.grpo.max_steps": budget})  # both sides start from the defaults
    started = time.monotonic()

    exp_id = setup_tracking(start.mlflow_uri, start.tracking.experiment, work / "mlartifacts")
    from mlflow import MlflowClient

    stage = MlflowClient(start.mlflow_uri).create_run(exp_id, run_name="hpo")
    tracking = Tracking(tracking_uri=start.mlflow_uri, experiment_id=exp_id, stage_run_id=stage.info.run_id)
    result = search(start, model, splits, work / "run", run_one=partial(run_trial, launcher_for=make_launcher), tracking=tracking)
    import optuna

    study = optuna.load_study(study_name=result.study_name, storage=start.hpo.storage)
    search_s = (max(t.datetime_complete for t in study.trials) - min(t.datetime_start for t in study.trials)).total_seconds()
    search_steps = sum(_trial_steps(work / "run", t) for t in study.trials)
    final_steps = budget - search_steps
    if final_steps < 1:
        raise SystemExit(f"the search spent {search_steps} of {budget} steps: nothing left to train; lower --trials")
    print(f"search: best {result.best_params} (val reward {result.best_value:.3f}), {search_steps} steps; "
          f"training {final_steps} more", file=sys.stderr)

    searched_cfg = apply_best(start, result.overrides | {"train.grpo.max_steps": final_steps})
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:  # both trainings at once, and the base model's score beside them
        searched_job = pool.submit(_train, searched_cfg, model, splits, work / "searched")
        default_job = pool.submit(_train, start, model, splits, work / "defaults")
        base = _base_eval(work, model, start, splits)
        searched_train, default_train = searched_job.result(), default_job.result()
    print(f"base model: holdout reward {base.reward:.3f}", file=sys.stderr)
    with ThreadPoolExecutor(2) as pool:
        searched, default = pool.map(
            lambda adapter: evaluate_model(model, start.model, splits["holdout"], start.train.rewards, start.evaluate,
                                           adapter=adapter),
            [searched_train.adapter_dir, default_train.adapter_dir],
        )
    searched_gain, default_gain = searched.reward - base.reward, default.reward - base.reward
    ratio = gain_ratio(searched_gain, default_gain)

    report = {
        "name": "hpo_gain" + ("_tiny" if args.tiny else ""),
        "metric": f"holdout reward gain over the base model ({base.n} prompts, greedy; reward = sum of {start.train.rewards})",
        "ratio": ratio,
        "ratio_note": None if ratio is not None else "the defaults side gained nothing: no ratio; compare the gains",
        "base_reward": base.reward,
        "defaults": {"reward": default.reward, "gain": default_gain, "per_reward": default.per_reward,
                     "steps": default_train.global_step,
                     "hyperparameters": {k: v for k, v in defaults.items()}},
        "searched": {"reward": searched.reward, "gain": searched_gain, "per_reward": searched.per_reward,
                     "steps": {"search": search_steps, "final_training": searched_train.global_step},
                     "search_s": search_s, "hyperparameters": result.overrides,
                     "best_val_reward": result.best_value},
        "base_per_reward": base.per_reward,
        "budget_steps": budget,
        "search": {"trials": [t.model_dump() for t in result.trials], "space": start.hpo.space.model_dump(exclude_none=True),
                   "steps_per_trial": start.hpo.steps, "eval_every": start.hpo.eval_every, "pruner": start.hpo.pruner},
        "wall_s_this_invocation": time.monotonic() - started,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "model": "tiny random llama" if args.tiny else model,
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{report['name']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    print(f"{'':12}{'reward':>8}{'gain':>8}  steps")
    print(f"{'base':12}{base.reward:8.3f}{'':8}")
    print(f"{'defaults':12}{default.reward:8.3f}{default_gain:+8.3f}  {default_train.global_step}")
    print(f"{'searched':12}{searched.reward:8.3f}{searched_gain:+8.3f}  {search_steps} search + {searched_train.global_step}")
    print(f"ratio of gains: {ratio if ratio is None else round(ratio, 2)} (goal >= 1.5); saved {path}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
