"""The headline benchmarks' code paths on tiny models: real GRPO steps, real NF4, results written and read back."""

import json

import pytest

pytestmark = pytest.mark.integration


def test_machine_limit_counts_flops_and_bounds(results):
    from bench.machine_limit import main

    report = main(["--tiny", "--steps", "2", "--repeats", "2"])
    assert (results / "machine_limit_tiny.json").is_file()
    assert report["matmul_peak"]["median"] > 0 and report["copy_bandwidth"]["median"] > 0
    assert 0 < report["train_phase"]["fraction"] and 0 < report["decode_batch1"]["fraction"]
    step = report["steps"][0]
    assert step["gen_s"] < step["step_s"] and step["train_s"] > 0 and step["seqs"] == 16
    assert "loaded" in report  # the load it saw, said beside the fractions (None: the machine was its own)


def test_gpu_check_dry_run_takes_the_gpu_code_path_on_the_cpu(tmp_path):
    from bench.gpu_check import main

    report = main(["--dry-run", "--models", "qwen2.5-0.5b", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "gpu_check_dry_run.json").read_text())
    assert saved["cases"] == json.loads(json.dumps(report["cases"]))
    assert [(c["model"], c["quantization"]) for c in saved["cases"]] == [
        ("qwen2.5-0.5b", "none"),
        ("qwen2.5-0.5b", "nf4"),
    ]
    for case in saved["cases"]:
        assert "error" not in case, case.get("error")
        m = case["measured"]
        # forced full-length completions: the shapes the planner's estimate assumes
        assert (m["prompt_len"], m["completion_len"]) == (12, 6)
        assert m["trainable_params"] == case["estimate"]["trainable_params"]  # the planner counts LoRA exactly
        # the adapter stays float32 and every tensor of it moves, over the 4-bit base too
        assert m["adapter_dtypes"] == ["torch.float32"] and m["adapter_finite"], case["quantization"]
        assert m["adapter_moved_min"] > 0.99, case["quantization"]  # bf16 rounding left as little as 0.43


@pytest.mark.slow  # a whole pipeline run of the recipe benchmark's chain: make test-slow (the default run's 12-minute budget)
def test_recipe_seeds_tiny_runs_the_shipped_recipe_through_the_pipeline_on_an_untuned_task(tmp_path, results):
    from bench.recipe_seeds import main

    work = tmp_path / "work"
    assert main(["--tiny", "--tasks", "subtract", "--seeds", "3", "--work", str(work), "--threads", "1"]) == 0
    subtract = json.loads((results / "recipe_seeds_tiny.json").read_text())["tasks"]["subtract"]
    run = subtract["per_seed"]["3"]
    assert run["steps"] == 2 and run["n"] > 0 and "train.grpo.seed=3" in run["overrides"]
    assert subtract["gain_interval"].startswith("an interval over 1 seed is not printed")
    assert (work / "tiny" / "subtract.jsonl").read_text().count("\n") == 45  # every a - b with b <= a <= 8


@pytest.mark.slow  # 2.4 min on 2 idle cores, 39 min on a loaded one: `make test-slow` runs it
def test_hpo_gain_tiny_searches_trains_and_scores_then_resumes_from_its_work_folder(tmp_path, results, monkeypatch):
    """One seed, the hand-tuned and searched arms on a tiny random model (2 steps each, a search of 1-step trials):
    the chain runs and is kept; a rerun trains nothing."""
    from bench.hpo_gain import main

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # --threads sets them for the trainers; restored after
        monkeypatch.setenv(name, "1")

    args = ["--tiny", "--seeds", "0", "--arms", "hand", "searched", "--work", str(tmp_path / "work"), "--threads", "1"]
    assert main(args) == 0
    report = json.loads((results / "hpo_gain_tiny.json").read_text())
    searched = report["runs"]["searched/0"]
    assert report["status"] == "complete" and "holdout_totals" in searched, searched.get("failed")
    assert searched["steps"] == 2 and 0 < searched["search_steps"] <= 3 + 1 and searched["search_over_training"] > 0
    assert report["summary"]["arms"]["searched"]["interval"] == "not printed: 1 seed (3 needed)"
    assert report["summary"]["goals"]["searched >= hand within noise or above"].startswith("not judged")
    kept = (tmp_path / "work" / "demo" / "tiny" / "runs.json").read_text()
    assert main(args) == 0  # everything kept: nothing trains again
    assert (tmp_path / "work" / "demo" / "tiny" / "runs.json").read_text() == kept


def test_scoring_precision_tiny_scores_one_adapter_in_both_precisions(results):
    from bench.scoring_precision import main

    assert main(["--tiny", "--rounds", "2"]) == 0
    run = json.loads((results / "scoring_precision_tiny.json").read_text())
    assert run["seconds"]["float32"]["n"] == run["seconds"]["bfloat16"]["n"] == 2 and run["ratio"]["median"] > 0
    (means,) = run["means"].values()
    assert set(means) == {"float32", "bfloat16"} and all(0 <= m <= 2 for m in means.values())


def test_step_profile_phases_add_up_to_the_real_trainers_step(results):
    """The profile wraps the real trainer's methods: each step's phases sum to its wall clock, the wrapped calls
    cover all but a sliver of it, and the counted passes are the ones TRL runs for the demo's settings. The tiny
    random model earns no reward, so its batches are flat: the loss pass runs only with the zero-advantage skip off."""
    from bench.step_profile import BACKWARD, DECODE, LOSS_FORWARD, NO_GRAD_LOGP, PREFILL, UNACCOUNTED, main

    main(["--tiny", "--steps", "1", "--threads", "1", "--set", "train.skip_zero_advantage=false"])
    run = json.loads((results / "step_profile_tiny.json").read_text())["runs"]["fp32"]
    steps = [run["warmup"], *run["steps"]]
    assert len(run["steps"]) == 1
    for step in steps:  # by construction, to float rounding: the clock never loses or double-counts time
        assert sum(step["phases"].values()) == pytest.approx(step["wall_s"], abs=1e-6)
    # the loop's own lines between wrapped calls (and the LR schedule): 5 % at most of the steps' time
    assert sum(s["phases"].get(UNACCOUNTED, 0.0) for s in steps) <= 0.05 * sum(s["wall_s"] for s in steps)
    calls = run["steps"][0]["calls"]
    assert calls[LOSS_FORWARD] == calls[BACKWARD] == 1
    # train.prefill_once (on): the distinct prompts' forward, then generate's own over each row's last prompt token
    assert calls[PREFILL] == 2
    assert 1 <= calls.get(DECODE, 0) <= run["shape"]["max_completion_length"] - 1
    assert calls.get(NO_GRAD_LOGP, 0) == len(run["logp_passes"]["no_grad"]) == 0  # beta 0, steps aligned
    profiled = run["profiled_step"]
    assert sum(p["s"] for p in profiled["phases"].values()) == pytest.approx(profiled["wall_s"], abs=1e-6)
    assert profiled["phases"][BACKWARD]["ops"] > 0  # the torch profiler saw the ops inside the phase ranges
    assert run["checkpoint"]["s"] > 0  # the last step writes the run's checkpoint


def test_step_profile_compares_two_arms_side_by_side(results):
    """The A/B mode: baseline and candidate alternate in one process from the same seed, each step's wall and CPU
    time kept (the last step's final checkpoint write left out), and the ratio with its per-round spread saved.
    The arms differ in the zero-advantage skip: on the tiny model's flat batches only the baseline runs a loss pass."""
    from bench.step_profile import LOSS_FORWARD, main

    main(
        [
            "--tiny",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--threads",
            "1",
            "--precision",
            "fp32",
            "--set",  # the skill alone: the tiny model never answers right, so every batch is flat (the recipe's
            "train.rewards=[correct_answer]",  # overlong penalty would vary with its random lengths)
            "--set",  # one generation per step, as drawn: the recipe's dynamic sampling draws more groups
            "train.dynamic_sampling.enabled=false",
            "--baseline",
            "train.skip_zero_advantage=false",
            "--candidate",
            "train.skip_zero_advantage=true",
        ]
    )
    report = json.loads((results / "step_profile_ab_tiny.json").read_text())
    assert report["arms"] == {
        "baseline": ["train.skip_zero_advantage=false"],
        "candidate": ["train.skip_zero_advantage=true"],
    }
    loss_passes = {}
    for arm in ("baseline", "candidate"):
        (run,) = report["runs"][arm]
        (step,) = run["steps"]
        assert step["wall_s"] > 0 and step["cpu_s"] > 0
        assert sum(step["phases"].values()) == pytest.approx(step["wall_s"], abs=1e-6)
        loss_passes[arm] = step["calls"].get(LOSS_FORWARD, 0)
    assert loss_passes == {"baseline": 1, "candidate": 0}
    assert report["wall"]["ratio"] > 0 and len(report["wall"]["rounds"]) == len(report["cpu"]["rounds"]) == 1
