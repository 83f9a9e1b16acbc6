"""Benchmark: where one GRPO step's time goes, phase by phase, in the project's real trainer on the demo recipe.

The trainer (`grpo_pipeline.trainer.train.run`, what `python -m grpo_pipeline.trainer` runs, with the demo's
checkpoint store and MLflow in a sqlite file as the demo has them) trains in this process. When it calls
`train()`, the bound methods of that trainer instance, of its callbacks, accelerator, optimizer and scheduler,
and the model's generation methods are wrapped with one clock. The clock counts every moment of a step for
the innermost phase running then, so the phases add up to the step by construction; the training loop's own
lines between wrapped calls are the explicit `unaccounted` phase. A step runs from one `get_batch_samples`
(the loop's first call) to the next. The first step warms up and is not counted; each phase's figure is its
median over the measured steps, its share that median over the median step.

One more step, the last, runs under `torch.profiler` (each phase is a `record_function` range there): the
torch ops under each phase give its op time, and the rest of the phase is Python (HF `generate`'s loop, TRL's
and HF's bookkeeping) plus the profiler's own cost. That step also writes the run's checkpoint (the demo writes
one every `train.checkpoint_every` steps); its write is reported per checkpoint and amortized per step.

fp32 always; bf16 too where the CPU computes it natively (avx512_bf16; emulated bf16 is ~50x slower).

    python -m bench.step_profile [--steps 4] [--precision auto|fp32|bf16] [--threads auto|N] [--set KEY=VALUE]... [--tiny]
    python -m bench.step_profile --markdown      # print the saved result's phase table (docs/benchmarks.md)
    python -m bench.step_profile --baseline train.merged_generation=false --candidate train.merged_generation=true \
        --rounds 2 --steps 3 --threads 1         # a cut side by side: step_profile_ab.json

`--set` passes config overrides (e.g. `train.grpo.logging_steps=10`) and `--threads` torch's thread count, to
measure a candidate cut against the default; `--save-as` keeps such a run apart from `step_profile.json`.

With `--candidate` (and `--baseline`) overrides the benchmark compares two arms in this one process: `--rounds`
times baseline then candidate, each a fresh trainer from the same seed, 1 warm-up and `--steps` measured steps
(no profiled step; the last step's final checkpoint write is left out of its time). Each step's wall clock and
this process's CPU time (`time.process_time`: the work done, which a shared machine's waits do not inflate) are
kept; the ratio is the candidate's median step over the baseline's, with the per-round ratios as its spread.

One module, past the ~600 lines a module is cut at, as every benchmark here: a benchmark is read whole, its clock,
its phases, its A/B mode and its report in one file, what it shares with the others in `bench/harness.py`.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import RESULTS, ROOT, add_threads_option, save, stamp, torch_threads
from bench.table import Row

NAME = "step_profile"
# The scheduler's step is left unwrapped (HF pickles the scheduler's __dict__ into each checkpoint): it is here.
UNACCOUNTED = "unaccounted (the training loop between wrapped calls, the LR schedule)"
RANGE = "step_profile/"  # prefix of the record_function ranges, one per phase

# phase -> group, in table order; every phase the wrappers below can name is here
GEN, SCORE, LOGP, BWD, OPT, OTHER = (
    "generation",
    "reward scoring and advantages",
    "log-probability forwards and loss",
    "backward",
    "optimizer",
    "everything else",
)
TOKENIZE = "prompt tokenization (chat template)"
PREFILL = "prefill forward"
DECODE = "decode forwards (one per new token)"
GEN_BOOKKEEPING = "KV cache and input bookkeeping per token"
GEN_LOOP = "sampling and decode loop (logits processors, multinomial, stop checks, setup)"
GEN_POST = "padding, EOS masks, text decoding, length metrics"
REWARDS = "reward functions"
ADVANTAGES = "advantages, padding, reward metrics"
NO_GRAD_LOGP = "log-prob forward without grad (old or reference policy)"
LOSS_FORWARD = "policy forward with grad (log-probs, entropies)"
LOSS_MATH = "GRPO objective from the log-probs"
BACKWARD = "backward"
CLIP = "gradient norm and clipping"
STEP = "AdamW step, zero_grad"
DATA = "data loading (get_batch_samples)"
SPLIT = "TRL batch shuffle and split (_prepare_inputs)"
TRAINING_STEP = "training_step's own lines (train mode, contexts)"
HF_COUNTS = "HF FLOP and token counts"
DISPATCH = "callback dispatch (HF)"
LOGGING = "logging: HF log, TRL metric averaging"
CHECKPOINT = "checkpoint write (HF save)"
EVALUATION = "evaluation"
CALLBACK = "callback: "  # + the callback's class name
PHASES: dict[str, str] = {
    TOKENIZE: GEN,
    PREFILL: GEN,
    DECODE: GEN,
    GEN_BOOKKEEPING: GEN,
    GEN_LOOP: GEN,
    GEN_POST: GEN,
    REWARDS: SCORE,
    ADVANTAGES: SCORE,
    NO_GRAD_LOGP: LOGP,
    LOSS_FORWARD: LOGP,
    LOSS_MATH: LOGP,
    BACKWARD: BWD,
    CLIP: OPT,
    STEP: OPT,
    DATA: OTHER,
    SPLIT: OTHER,
    TRAINING_STEP: OTHER,
    HF_COUNTS: OTHER,
    DISPATCH: OTHER,
    LOGGING: OTHER,
    CHECKPOINT: OTHER,
    EVALUATION: OTHER,
}
COMPUTE = (PREFILL, DECODE, NO_GRAD_LOGP, LOSS_FORWARD, BACKWARD, STEP)  # the model's own passes and update


def group_of(phase: str) -> str:
    """
    >>> group_of(DECODE), group_of("callback: HealthCallback"), group_of(UNACCOUNTED)
    ('generation', 'everything else', 'everything else')
    """
    return PHASES.get(phase, OTHER)


def logp_passes(
    grad_accum: int, steps_per_generation: int, num_iterations: int, beta: float, vllm_is: bool, checkpointing: bool
) -> dict:
    """The log-probability forwards TRL 1.16's GRPOTrainer runs per generation batch, and why: the policy's, with
    grad, in the loss (always); the old policy's, without grad, when generation and optimizer steps are misaligned
    (`gradient_accumulation_steps % (steps_per_generation * num_iterations)`) or vLLM's importance sampling asks for
    it; the reference's when `beta != 0`. With `gradient_checkpointing` (GRPOConfig's default: True) the backward
    reruns each decoder layer's forward: one more forward, inside the backward phase.

    >>> logp_passes(1, 1, 1, 0.0, False, False)["no_grad"], logp_passes(1, 1, 1, 0.0, False, False)["in_backward"]
    ([], [])
    >>> [p.split(":")[0] for p in logp_passes(1, 1, 2, 0.04, False, True)["no_grad"]]
    ['old policy', 'reference']
    """
    no_grad = []
    if grad_accum % (steps_per_generation * num_iterations) != 0 or vllm_is:
        no_grad.append(
            "old policy: generation and optimizer steps misaligned (gradient_accumulation_steps "
            f"{grad_accum} % (steps_per_generation {steps_per_generation} x num_iterations {num_iterations}) != 0)"
            if not vllm_is
            else "old policy: vLLM importance-sampling correction"
        )
    if beta != 0.0:
        no_grad.append(f"reference: KL penalty beta={beta}")
    return {
        "with_grad": ["policy: the loss's own forward, whose backward trains"],
        "no_grad": no_grad,
        "in_backward": ["recompute: gradient_checkpointing reruns every decoder layer's forward"]
        if checkpointing
        else [],
    }


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm")


def top_ops(averages: Any, wall_s: float, n: int = 12) -> dict:
    """The profiled step's torch ops by self time (the largest `n`, and the matrix multiplications' total), in
    seconds and as shares of the step."""
    ops = [e for e in averages if not e.key.startswith(RANGE)]
    matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMULS) / 1e6
    ranked = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:n]
    return {
        "matmul_s": matmul,
        "matmul_share": matmul / wall_s,
        "top": [
            {
                "op": e.key,
                "self_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / 1e6 / wall_s,
                "calls": e.count,
            }
            for e in ranked
        ],
    }


class Clock:
    """Exclusive wall-clock attribution: between two calls, time counts for the phase on top of the stack
    (`UNACCOUNTED` when none is). Each phase also opens a `record_function` range, for a torch.profiler trace."""

    def __init__(self, record: Callable[[str], Any]) -> None:
        self.record = record
        self.stack: list[tuple[str, Any]] = []
        self.mark = time.perf_counter()
        self.cpu_mark = time.process_time()
        self.step: dict[str, float] | None = None
        self.step_cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.started = self.cpu_started = 0.0
        self.steps: list[dict] = []

    def _attribute(self) -> None:
        now, cpu = time.perf_counter(), time.process_time()
        if self.step is not None:
            phase = self.stack[-1][0] if self.stack else UNACCOUNTED
            self.step[phase] += now - self.mark
            self.step_cpu[phase] += cpu - self.cpu_mark
        self.mark, self.cpu_mark = now, cpu

    def enter(self, phase: str) -> None:
        self._attribute()
        scope = self.record(RANGE + phase)
        scope.__enter__()
        self.stack.append((phase, scope))
        if self.step is not None:
            self.calls[phase] += 1

    def leave(self) -> None:
        self._attribute()
        self.stack.pop()[1].__exit__(None, None, None)

    def top(self) -> str | None:
        return self.stack[-1][0] if self.stack else None

    def inside(self, phase: str) -> bool:
        return any(p == phase for p, _ in self.stack)

    def next_step(self) -> None:
        """Close the running step (if any) and open the next one."""
        self._attribute()
        if self.step is not None:
            self.steps.append(
                {
                    "wall_s": self.mark - self.started,
                    "phases": dict(self.step),
                    "calls": dict(self.calls),
                    "cpu_s": self.cpu_mark - self.cpu_started,
                    "cpu_phases": dict(self.step_cpu),
                }
            )
        self.step, self.calls, self.started = defaultdict(float), defaultdict(int), self.mark
        self.step_cpu, self.cpu_started = defaultdict(float), self.cpu_mark


def wrap(clock: Clock, owner: Any, name: str, phase: str | Callable[[], str | None]) -> None:
    """Replace `owner.name` (a bound method) on that instance by one timed as `phase` (or as what `phase()`
    returns at the call; None: not a phase of its own there, its time stays with the caller's)."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        chosen = phase() if callable(phase) else phase
        if chosen is None:
            return original(*args, **kwargs)
        clock.enter(chosen)
        try:
            return original(*args, **kwargs)
        finally:
            clock.leave()

    setattr(owner, name, timed)


def instrument(trainer: Any, clock: Clock, on_last_step: Callable[[], None], on_end: Callable[[], None]) -> None:
    """Wrap the real trainer instance's methods (TRL's GRPOTrainer, HF's Trainer loop, the project's callbacks)."""
    import torch
    from transformers import TrainerCallback

    def data_loading(*args, **kwargs):
        clock.next_step()  # the training loop's first call of each optimizer step
        if trainer.state.global_step == trainer.state.max_steps - 1:
            on_last_step()
        clock.enter(DATA)
        try:
            return get_batch_samples(*args, **kwargs)
        finally:
            clock.leave()

    get_batch_samples = trainer.get_batch_samples
    trainer.get_batch_samples = data_loading

    def finalize(*args, **kwargs):
        clock.next_step()  # the last step ends where HF's wrap-up begins
        clock.step = None
        on_end()
        return finalize_training(*args, **kwargs)

    finalize_training = trainer._finalize_training
    trainer._finalize_training = finalize

    for name, phase in (
        ("training_step", TRAINING_STEP),
        ("_prepare_inputs", SPLIT),
        ("_generate_and_score_completions", ADVANTAGES),
        ("_generate", GEN_POST),
        ("_tokenize_prompts", TOKENIZE),
        ("_generate_single_turn", GEN_POST),
        ("_calculate_rewards", REWARDS),
        ("compute_loss", LOSS_MATH),
        ("_clip_grad_norm", CLIP),
        ("_get_grad_norm", CLIP),
        ("floating_point_ops", HF_COUNTS),
        ("_track_num_input_tokens", HF_COUNTS),
        ("_maybe_log_save_evaluate", LOGGING),
        ("log", LOGGING),
        ("_save_checkpoint", CHECKPOINT),
        ("_evaluate", EVALUATION),
    ):
        wrap(clock, trainer, name, phase)
    wrap(
        clock,
        trainer,
        "_get_per_token_logps_and_entropies",
        lambda: LOSS_FORWARD if torch.is_grad_enabled() else NO_GRAD_LOGP,
    )
    wrap(clock, trainer.accelerator, "backward", BACKWARD)
    wrap(clock, trainer.callback_handler, "call_event", DISPATCH)
    for callback in trainer.callback_handler.callbacks:
        for event in [e for e in dir(callback) if e.startswith("on_")]:
            wrap(clock, callback, event, CALLBACK + type(callback).__name__)

    # The module HF generate runs on: under PEFT the base model, which holds the LoRA layers.
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    wrap(clock, model, "generate", GEN_LOOP)
    wrap(clock, model, "_prefill", PREFILL)
    wrap(clock, model, "prepare_inputs_for_generation", GEN_BOOKKEEPING)
    wrap(clock, model, "_update_model_kwargs_for_generation", GEN_BOOKKEEPING)
    # a forward is a decode step where generate's loop calls it; under `_generate_single_turn` but outside generate
    # it is train.prefill_once's prefill of the distinct prompts; elsewhere it is part of its caller's phase
    wrap(
        clock,
        model,
        "forward",
        lambda: DECODE if clock.top() == GEN_LOOP else PREFILL if clock.top() == GEN_POST else None,
    )

    class Optimizer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # the optimizer exists from here on
            wrap(clock, trainer.optimizer, "step", STEP)
            wrap(clock, trainer.model_wrapped, "zero_grad", STEP)

    trainer.add_callback(Optimizer())


def op_time(events: Any) -> dict[str, dict]:
    """Per phase, from a torch.profiler event list: seconds in top-level torch ops (an op's children are inside its
    own time) and their count; ops outside any phase go to UNACCOUNTED."""
    out: dict[str, dict] = defaultdict(lambda: {"op_s": 0.0, "ops": 0})
    for event in events:
        if event.name.startswith(RANGE):
            continue
        parent = event.cpu_parent
        if parent is not None and not parent.name.startswith(RANGE):
            continue  # nested in another op
        phase = parent.name[len(RANGE) :] if parent is not None else UNACCOUNTED
        out[phase]["op_s"] += event.cpu_time_total / 1e6
        out[phase]["ops"] += 1
    return dict(out)


def summarize(steps: list[dict]) -> dict:
    """Median seconds, share of the median step and calls per step, for each phase of the measured steps.

    >>> s = summarize([{"wall_s": 2.0, "phases": {"a": 1.5, "b": 0.5}, "calls": {"a": 2}},
    ...                {"wall_s": 4.0, "phases": {"a": 3.0, "b": 1.0}, "calls": {"a": 2}}])
    >>> s["step_s"]["median"], s["phases"]["a"]["median_s"], s["phases"]["a"]["share"], s["phases"]["b"]["calls"]
    (3.0, 2.25, 0.75, 0.0)
    """
    names = sorted(
        {p for s in steps for p in s["phases"]}, key=lambda p: (list(PHASES).index(p) if p in PHASES else 99, p)
    )
    step_s = statistics.median(s["wall_s"] for s in steps)
    phases = {}
    for name in names:
        med = statistics.median(s["phases"].get(name, 0.0) for s in steps)
        phases[name] = {
            "group": group_of(name),
            "median_s": med,
            "share": med / step_s,
            "calls": statistics.median(s["calls"].get(name, 0) for s in steps),
        }
    walls = [s["wall_s"] for s in steps]
    cpus = [s["cpu_s"] for s in steps if "cpu_s" in s]
    return {
        "step_s": {"median": step_s, "min": min(walls), "max": max(walls), "n": len(walls)},
        "cpu_s": {"median": statistics.median(cpus), "min": min(cpus), "max": max(cpus)} if cpus else None,
        "phases": phases,
        "compute_share": sum(phases[p]["share"] for p in COMPUTE if p in phases),
    }


def without_checkpoint(step: dict) -> dict:
    """A step with its checkpoint write (HF's save and CheckpointSync's hand-off) taken out of its time.

    >>> s = without_checkpoint({"wall_s": 3.0, "cpu_s": 2.0, "phases": {CHECKPOINT: 1.0, BACKWARD: 2.0},
    ...                         "cpu_phases": {CHECKPOINT: 0.5, BACKWARD: 1.5}, "calls": {}})
    >>> s["wall_s"], s["cpu_s"], list(s["phases"])
    (2.0, 1.5, ['backward'])
    """
    cut = (CHECKPOINT, CALLBACK + "CheckpointSync")
    wall = sum(step["phases"].get(p, 0.0) for p in cut)
    cpu = sum(step.get("cpu_phases", {}).get(p, 0.0) for p in cut)
    return {
        **step,
        "wall_s": step["wall_s"] - wall,
        "cpu_s": step["cpu_s"] - cpu,
        "phases": {p: v for p, v in step["phases"].items() if p not in cut},
        "cpu_phases": {p: v for p, v in step.get("cpu_phases", {}).items() if p not in cut},
    }


def run_profile(cfg: Any, model_dir: Path, work: Path, steps: int, trace: Path | None, profile: bool = True) -> dict:
    """Train 1 + `steps` + 1 steps with the real trainer, instrumented; the clock's steps and the profiled one.
    Without `profile`: 1 + `steps` (set `train.grpo.max_steps` so), the last one's final checkpoint write left out."""
    import torch

    from grpo_pipeline.tasks.data.demo_task import generate
    from grpo_pipeline.tasks.data.splits import write_splits
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.trainer import train

    splits = write_splits(generate(cfg.data.demo), work / "data")
    spec = build_job_spec(
        cfg.train, cfg.model, str(model_dir), splits, work / "run", mlflow_tracking_uri=f"sqlite:///{work}/mlflow.db"
    )
    clock = Clock(torch.profiler.record_function)
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    seen: dict[str, Any] = {}

    def start_profiler():
        if profile:
            profiler.__enter__()
            seen["profiling"] = True

    def stop_profiler():
        if seen.get("profiling"):
            profiler.__exit__(None, None, None)

    from trl import GRPOTrainer

    real_train = GRPOTrainer.train

    def instrumented_train(self, *args, **kwargs):
        seen["trainer"] = self
        instrument(self, clock, start_profiler, stop_profiler)
        return real_train(self, *args, **kwargs)

    GRPOTrainer.train = instrumented_train  # type: ignore[method-assign]  # only for this run
    try:
        result = train.run(spec)
    finally:
        GRPOTrainer.train = real_train  # type: ignore[method-assign]
    trainer = seen["trainer"]
    a = trainer.args
    if not profile:
        if len(clock.steps) != steps + 1:
            raise RuntimeError(f"expected {steps + 1} steps, the clock saw {len(clock.steps)}")
        measured = [*clock.steps[1:-1], without_checkpoint(clock.steps[-1])]
        return {
            "precision": result.precision,
            "threads": torch.get_num_threads(),
            "warmup": clock.steps[0],
            "steps": measured,
            "summary": summarize(measured),
            "gradient_checkpointing": bool(a.gradient_checkpointing),
            "final_loss": result.metrics.get("train_loss"),
        }
    if len(clock.steps) != steps + 2:
        raise RuntimeError(f"expected {steps + 2} steps, the clock saw {len(clock.steps)}")
    profiled = clock.steps[-1]
    ops = op_time(profiler.events())
    if trace:
        profiler.export_chrome_trace(str(trace))
    checkpoint_s = profiled["phases"].get(CHECKPOINT, 0.0) + profiled["phases"].get(CALLBACK + "CheckpointSync", 0.0)
    return {
        "precision": result.precision,
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "warmup": clock.steps[0],
        "steps": clock.steps[1:-1],
        "summary": summarize(clock.steps[1:-1]),
        "profiled_step": {
            "wall_s": profiled["wall_s"],
            "phases": {p: {"s": s, **ops.get(p, {"op_s": 0.0, "ops": 0})} for p, s in profiled["phases"].items()},
            "calls": profiled["calls"],
            "ops": top_ops(profiler.key_averages(), profiled["wall_s"]),
        },
        "checkpoint": {
            "s": checkpoint_s,
            "every": spec.train.checkpoint_every,
            "amortized_s": checkpoint_s / spec.train.checkpoint_every,
        },
        "logp_passes": logp_passes(
            a.gradient_accumulation_steps,
            a.steps_per_generation,
            a.num_iterations,
            a.beta,
            bool(a.use_vllm and getattr(a, "vllm_importance_sampling_correction", False)),
            bool(a.gradient_checkpointing),
        ),
        "gradient_checkpointing": bool(a.gradient_checkpointing),
        "shape": {
            "sequences": a.per_device_train_batch_size,
            "max_completion_length": a.max_completion_length,
            "num_generations": a.num_generations,
        },
        "final_loss": result.metrics.get("train_loss"),
    }


def precisions(choice: str, native_bf16: bool) -> list[str]:
    """
    >>> precisions("auto", False), precisions("auto", True), precisions("bf16", False)
    (['fp32'], ['fp32', 'bf16'], ['bf16'])
    """
    if choice == "auto":
        return ["fp32", "bf16"] if native_bf16 else ["fp32"]
    return [choice]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="measured steps (one warm-up and one profiled step more)")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    add_threads_option(parser)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override")
    parser.add_argument("--save-as", default=None, help=f"result name under bench/results/ ({NAME}, {NAME}_ab)")
    parser.add_argument("--baseline", action="append", default=[], metavar="KEY=VALUE", help="an A/B baseline override")
    parser.add_argument(
        "--candidate", action="append", default=[], metavar="KEY=VALUE", help="an A/B candidate override (A/B mode)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="A/B mode: baseline, candidate pairs, alternating")
    parser.add_argument("--trace", type=Path, help="write the profiled step's Chrome trace here")
    parser.add_argument("--tiny", action="store_true", help="a tiny random model instead of SmolLM2-135M")
    parser.add_argument("--markdown", action="store_true", help="print the saved result's phase table, run nothing")
    opts = parser.parse_args(argv)
    ab = bool(opts.candidate)
    opts.save_as = opts.save_as or (NAME + "_ab" if ab else NAME)
    if opts.markdown:
        path = RESULTS / f"{opts.save_as}.json"
        if not path.is_file():
            parser.exit(2, f"{path} not found: run `python -m bench.step_profile` first\n")
        import json

        saved = json.loads(path.read_text())
        print(ab_markdown(saved) if "arms" in saved else markdown(saved))
        return {}
    if opts.steps < 1 or opts.rounds < 1:
        parser.exit(2, "--steps and --rounds must be at least 1\n")
    if opts.baseline and not ab:
        parser.exit(2, "--baseline needs --candidate (the A/B mode)\n")

    import torch

    from grpo_pipeline.configs.schema import ConfigError, load_config
    from grpo_pipeline.tasks.model import ensure_demo_model
    from grpo_pipeline.trainer.precision import cpu_has_native_bf16

    native = cpu_has_native_bf16()
    chosen = precisions(opts.precision, native)
    if "bf16" in chosen and not native and not torch.cuda.is_available():
        parser.exit(2, "--precision bf16: this CPU has no avx512_bf16 (bf16 would run ~50x slower); use fp32\n")
    if ab and len(chosen) > 1:
        parser.exit(2, "A/B mode compares one precision: pass --precision fp32 or bf16\n")
    base = [f"train.grpo.max_steps={opts.steps + (1 if ab else 2)}", *opts.set]
    try:
        cfgs = {
            p: load_config(ROOT / "configs" / "demo-cpu.yaml", [*base, f"train.grpo.bf16={p == 'bf16'}"])
            for p in chosen
        }
        arms = {
            arm: load_config(
                ROOT / "configs" / "demo-cpu.yaml", [*base, f"train.grpo.bf16={chosen[0] == 'bf16'}", *overrides]
            )
            for arm, overrides in (("baseline", opts.baseline), ("candidate", opts.candidate))
        }
    except ConfigError as exc:
        parser.exit(2, f"{exc}\n")
    first = next(iter(cfgs.values()))
    work = Path(tempfile.mkdtemp(prefix="bench-step-profile-"))
    if opts.tiny:
        from tests.tiny_model import create_random_model

        model_dir = create_random_model(work / "tiny")
    else:
        model_dir = ensure_demo_model(first.data_dir / "models")
    load = os.getloadavg()[0]
    threads, before = torch_threads(opts.threads), torch.get_num_threads()
    runs = {}
    try:
        if threads:
            torch.set_num_threads(threads)
        if ab:
            return run_ab(opts, arms, model_dir, work, load, native)
        for precision, cfg in cfgs.items():
            print(f"[{NAME}] {precision}: {opts.steps} measured steps of {model_dir.name}", flush=True)
            runs[precision] = run_profile(
                cfg, model_dir, work / precision, opts.steps, opts.trace if precision == chosen[0] else None
            )
            print(markdown({"runs": {precision: runs[precision]}}), flush=True)
    finally:
        torch.set_num_threads(before)  # a caller in this process (a test) keeps its own setting
        shutil.rmtree(work, ignore_errors=True)
    name = opts.save_as + ("_tiny" if opts.tiny else "")
    report = {
        "name": name,
        "model": str(model_dir),
        "native_bf16": native,
        "overrides": opts.set,
        "threads_option": opts.threads,  # auto: 1 when the load average says a core is already busy
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "load_average": {"start": load, "end": os.getloadavg()[0]},
        "runs": runs,
        **stamp(),
    }
    save(name, report)
    print(f"[{NAME}] saved to {RESULTS / name}.json", flush=True)
    return report


def run_ab(opts: argparse.Namespace, arms: dict, model_dir: Path, work: Path, load: float, native: bool) -> dict:
    """Alternate the arms `opts.rounds` times (fresh trainer, same seed each run); save and return the comparison."""
    import torch

    runs: dict[str, list[dict]] = {"baseline": [], "candidate": []}
    report: dict = {}
    for i in range(opts.rounds):
        for arm, cfg in arms.items():
            print(f"[{NAME}] round {i + 1}/{opts.rounds} {arm}: {opts.steps} measured steps", flush=True)
            run = run_profile(cfg, model_dir, work / f"{arm}-{i}", opts.steps, None, profile=False)
            runs[arm].append(run)
            s = run["summary"]
            print(
                f"[{NAME}] {arm}: median step {s['step_s']['median']:.2f} s wall, {s['cpu_s']['median']:.2f} s CPU",
                flush=True,
            )
        report = {  # saved after every round: a long comparison stopped early keeps its finished rounds
            "name": opts.save_as + ("_tiny" if opts.tiny else ""),
            "model": str(model_dir),
            "native_bf16": native,
            "overrides": opts.set,
            "arms": {"baseline": opts.baseline, "candidate": opts.candidate},
            "steps": opts.steps,
            "rounds": i + 1,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "load_average": {"start": load, "end": os.getloadavg()[0]},
            "runs": runs,
            **ab_ratios(runs),
            **stamp(),
        }
        save(report["name"], report)
    print(ab_markdown(report), flush=True)
    print(f"[{NAME}] saved to {RESULTS / report['name']}.json", flush=True)
    return report


def ab_ratios(runs: dict[str, list[dict]]) -> dict:
    """Candidate over baseline: the median of all measured steps' wall and CPU seconds, the per-round ratios of the
    runs' medians as spread, and each phase group's median seconds per arm.

    >>> run = lambda w, c: {"steps": [{"wall_s": w, "cpu_s": c, "phases": {DECODE: w / 2, BACKWARD: w / 2}}]}
    >>> r = ab_ratios({"baseline": [run(10, 8), run(12, 8)], "candidate": [run(6, 4), run(6, 4)]})
    >>> r["wall"]["ratio"], r["wall"]["rounds"], r["cpu"]["ratio"], r["groups"][GEN]
    (0.5454545454545454, [0.6, 0.5], 0.5, {'baseline': 5.5, 'candidate': 3.0})
    """
    out: dict[str, Any] = {}
    for metric, key in (("wall", "wall_s"), ("cpu", "cpu_s")):
        medians = {arm: statistics.median(s[key] for r in rs for s in r["steps"]) for arm, rs in runs.items()}
        rounds = [
            statistics.median(s[key] for s in c["steps"]) / statistics.median(s[key] for s in b["steps"])
            for b, c in zip(runs["baseline"], runs["candidate"], strict=True)
        ]
        out[metric] = {**medians, "ratio": medians["candidate"] / medians["baseline"], "rounds": rounds}
    out["groups"] = {
        group: {
            arm: statistics.median(
                sum(v for p, v in s["phases"].items() if group_of(p) == group) for r in rs for s in r["steps"]
            )
            for arm, rs in runs.items()
        }
        for group in (GEN, SCORE, LOGP, BWD, OPT, OTHER)
    }
    return out


def ab_markdown(report: dict) -> str:
    """The A/B result as a few lines: the arms, the ratios with their per-round spread, the phase groups."""
    w, c = report["wall"], report["cpu"]
    lines = [
        f"baseline {' '.join(report['arms']['baseline']) or '(the config as is)'} against candidate "
        f"{' '.join(report['arms']['candidate'])}: {report['rounds']} rounds alternating, {report['steps']} measured "
        f"steps each, {report['threads']} torch threads, load average {report['load_average']['start']:.1f} at the "
        "start.",
        "",
        "| | baseline s | candidate s | ratio | per round |",
        "|---|---|---|---|---|",
        f"| median step, wall | {w['baseline']:.2f} | {w['candidate']:.2f} | **{w['ratio']:.3f}** | "
        f"{', '.join(f'{x:.3f}' for x in w['rounds'])} |",
        f"| median step, CPU | {c['baseline']:.2f} | {c['candidate']:.2f} | **{c['ratio']:.3f}** | "
        f"{', '.join(f'{x:.3f}' for x in c['rounds'])} |",
    ]
    for group, g in report["groups"].items():
        if g["baseline"] or g["candidate"]:
            ratio = f"{g['candidate'] / g['baseline']:.3f}" if g["baseline"] else "–"
            lines.append(f"| {group} (wall) | {g['baseline']:.3f} | {g['candidate']:.3f} | {ratio} | |")
    return "\n".join(lines)


def markdown(report: dict) -> str:
    """The phase table of each precision in a result: groups with their phases, seconds, shares, calls, and the
    profiled step's torch-op share of each phase."""
    out = []
    for precision, r in report["runs"].items():
        s, prof = r["summary"], r["profiled_step"]["phases"]
        lines = [
            f"**{precision}**, {r['threads']} torch threads: median step **{s['step_s']['median']:.2f} s** "
            f"({s['step_s']['min']:.2f}–{s['step_s']['max']:.2f}, {s['step_s']['n']} steps); the model's "
            f"passes (prefill, decode and log-prob forwards, backward, AdamW) {100 * s['compute_share']:.0f} % of it.",
            "",
            "| phase | median s | share | calls / step | torch ops in it (profiled step) |",
            "|---|---|---|---|---|",
        ]
        groups: dict[str, list[str]] = defaultdict(list)
        for phase, p in s["phases"].items():
            groups[p["group"]].append(phase)
        for group in (GEN, SCORE, LOGP, BWD, OPT, OTHER):
            members = groups.get(group, [])
            if not members:
                continue
            total = sum(s["phases"][m]["median_s"] for m in members)
            lines.append(f"| **{group}** | **{total:.3f}** | **{100 * total / s['step_s']['median']:.1f} %** | | |")
            for m in sorted(members, key=lambda m: -s["phases"][m]["median_s"]):
                p = s["phases"][m]
                seen = prof.get(m)
                ops = f"{100 * seen['op_s'] / seen['s']:.0f} % ({seen['ops']} ops)" if seen and seen["s"] > 0 else "–"
                lines.append(f"| {m} | {p['median_s']:.3f} | {100 * p['share']:.1f} % | {p['calls']:g} | {ops} |")
        c = r["checkpoint"]
        passes = r["logp_passes"]
        forwards = passes["with_grad"] + passes["no_grad"] + passes.get("in_backward", [])
        lines += [
            "",
            f"Forward passes over the batch per step, beside generation: {len(forwards)} ({'; '.join(forwards)}). "
            f"Checkpoint write (HF save and the upload hand-off, at the profiled step): {c['s']:.2f} s, every "
            f"{c['every']} steps: {c['amortized_s']:.3f} s per step, not in the median step.",
        ]
        ops = r["profiled_step"].get("ops")
        if ops:
            top = ", ".join(f"{o['op']} {100 * o['share']:.0f} %" for o in ops["top"][:6])
            lines.append(
                f"Profiled step ({r['profiled_step']['wall_s']:.1f} s): matrix multiplications "
                f"{100 * ops['matmul_share']:.0f} % of it; largest ops by self time: {top}."
            )
        out.append("\n".join(lines))
    return "\n\n".join(out)


def table_rows(load) -> list[Row]:
    result = load(NAME)
    bench = "GRPO demo step by phase: the model's passes (prefill, decode, forward, backward, AdamW) as a share"
    if result is None:
        return [Row(f"{bench} (`bench.step_profile`)", "step", "arithmetic", None, "", note="not run yet", unit="%")]
    rows = []
    for precision, r in result["runs"].items():
        s = r["summary"]
        gen = sum(p["median_s"] for p in s["phases"].values() if p["group"] == GEN)
        rows.append(
            Row(
                f"{bench}, {precision} (`bench.step_profile`)",
                f"step: {s['step_s']['median']:.2f} s (generation {gen:.2f} s)",
                "the model's passes",
                100 * s["compute_share"],
                "",
                note="reported (share)",
                unit="%",
            )
        )
    # the cuts' A/B runs: `_ab` (merged generation and the compact LM head), `_ab_all` (every cut against none, on
    # the AVX2 kind), `_ab_all_bf16` and `_ab_all_fp32_avx512` (the same on the AVX512-BF16 kind, in each precision)
    saved = ("_ab", "_ab_all", "_ab_all_bf16", "_ab_all_fp32_avx512")
    for ab in filter(None, (load(NAME + suffix) for suffix in saved)):
        # CPU time per step: what a niced benchmark on a shared machine can still measure; the wall ratio is in the name
        c, w = ab["cpu"], ab["wall"]
        precision = ab["runs"]["baseline"][0].get("precision", "fp32")
        rows.append(
            Row(
                f"GRPO demo step, {precision} on {'an AVX512-BF16' if ab.get('native_bf16') else 'an AVX2-only'} "
                f"CPU, process CPU time, side by side (`bench.step_profile --candidate`, {ab['rounds']} "
                f"round(s) x {ab['steps']} step(s), {ab['threads']} thread(s); wall {w['ratio']:.2f}x at load "
                f"{ab['load_average']['start']:.0f}-{ab['load_average']['end']:.0f})",
                f"{' '.join(ab['arms']['baseline']) or 'the demo config'}: {c['baseline']:.2f} CPU s",
                f"{' '.join(ab['arms']['candidate'])}: {c['candidate']:.2f} CPU s",
                c["ratio"],
                "<= 0.5",  # issue #34's goal for the demo's median step
                spread=(min(c["rounds"]), max(c["rounds"])) if len(c["rounds"]) > 1 else None,
            )
        )
    return rows


if __name__ == "__main__":
    main()
