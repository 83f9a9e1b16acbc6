"""The planner: shipped model configs, the seed's memory figures, monotonic properties, GPU choice, budget
guard, actual cost and the `plan` command. Pure: no model, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_pipeline.configs.library_fields import default
from grpo_pipeline.tasks.plan import (
    GIB,
    KNOWN_MODELS,
    Assumptions,
    BudgetExceeded,
    PlanError,
    Workload,
    actual_cost,
    architecture,
    check_budget,
    estimate_memory,
    load_catalog,
    load_model_config,
    make_plan,
    plan_local,
    workload_for,
)
from grpo_pipeline.tasks.plan.architecture import PEFT_DEFAULT_TARGETS


def _sections(cfg):
    """What the planner's stage functions take of a PipelineConfig."""
    return cfg.model, cfg.train, cfg.plan


GB = 1e9  # the seed states its figures in GB

# Published parameter counts (model cards), in billions.
PUBLISHED = {
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.61,
    "qwen2.5-14b": 14.7,
    "qwen2.5-32b": 32.5,
    "qwen2.5-72b": 72.7,
    "llama-3.2-1b": 1.23,
    "llama-3.2-3b": 3.21,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.6,
    "smollm2-135m": 0.135,
}


def cfg(name: str) -> dict:
    return load_model_config(name)[1]


LAYOUT = ("per_device_batch", "gradient_checkpointing", "generation_batch", "shards")


def memory(model_config: dict, **fields):
    """estimate_memory for a Workload of these fields, at the layout keywords among them."""
    layout = {k: fields.pop(k) for k in LAYOUT if k in fields}
    return estimate_memory(model_config, Workload(model="m", **fields), **layout)


@pytest.mark.parametrize("name", sorted(KNOWN_MODELS))
def test_shipped_configs_have_the_published_sizes(name):
    assert architecture(cfg(name)).params / 1e9 == pytest.approx(PUBLISHED[name], rel=0.015)


def test_shipped_configs_are_valid_transformers_configs():
    from transformers import AutoConfig

    for name in KNOWN_MODELS:
        c = cfg(name)
        hf = AutoConfig.for_model(**c)
        assert (hf.hidden_size, hf.num_hidden_layers, hf.num_key_value_heads) == (
            c["hidden_size"],
            c["num_hidden_layers"],
            c["num_key_value_heads"],
        )


def test_models_by_hub_id_path_and_directory(tmp_path):
    assert load_model_config("meta-llama/Llama-3.1-70B-Instruct")[0] == "llama-3.1-70b"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg("qwen2.5-0.5b")))
    assert load_model_config(str(tmp_path / "m"))[1]["hidden_size"] == 896
    assert load_model_config(str(tmp_path / "m" / "config.json"))[1]["hidden_size"] == 896
    with pytest.raises(PlanError, match="config.json path"):
        load_model_config("org/unknown-model")
    with pytest.raises(PlanError, match="mixture-of-experts"):
        architecture({**cfg("qwen2.5-0.5b"), "num_local_experts": 8})


# --- the seed's figures: 7B FP16 + LoRA 25-38 GB (14 weights, 0.5-4 adapters, 8-16 optimizer, 2-4 activations)

SEVEN_B = dict(
    quantization="none",
    dtype="bfloat16",
    lora_rank=16,
    lora_targets="all-linear",
    optimizer="adamw_torch",
    gradient_checkpointing=True,
    per_device_batch=8,
    prompt_tokens=256,
    completion_tokens=512,
)


def test_7b_weights_match_the_seed_per_parameter():
    est = memory(cfg("qwen2.5-7b"), **SEVEN_B)
    # 2 bytes per parameter: the seed's 14 GB is a 7.0 B model; Qwen2.5-7B has 7.62 B parameters
    assert est.weights == pytest.approx(2 * est.params, rel=1e-9)
    assert 14 * GB <= est.weights <= 16 * GB


@pytest.mark.parametrize("rank", [16, 64])
def test_7b_adapter_training_state_is_in_the_seeds_adapter_range(rank):
    est = memory(cfg("qwen2.5-7b"), **{**SEVEN_B, "lora_rank": rank})
    # weights alone are 4 bytes per adapter parameter (0.16 GB at r=16); with their gradients and AdamW
    # states it is 16 bytes per parameter: 0.65 GB at r=16, 2.6 GB at r=64
    assert 0.5 * GB <= est.adapter + est.gradients + est.optimizer <= 4 * GB


@pytest.mark.parametrize("completion", [256, 512])
def test_7b_activations_with_checkpointing_are_in_the_seeds_range(completion):
    est = memory(cfg("qwen2.5-7b"), **{**SEVEN_B, "completion_tokens": completion})
    assert 2 * GB <= est.activations <= 4 * GB


def test_seed_optimizer_figure_is_full_model_optimizer_state_not_lora():
    lora = memory(cfg("qwen2.5-7b"), **SEVEN_B)
    assert lora.optimizer < 0.5 * GB  # AdamW over 40 M adapter parameters: 0.32 GB
    full_8bit = memory(cfg("qwen2.5-7b"), **{**SEVEN_B, "lora_rank": 0, "optimizer": "adamw_8bit"})
    assert 8 * GB <= full_8bit.optimizer <= 16 * GB  # 2 bytes x 7.62 B parameters: where 8-16 GB comes from
    # with that optimizer figure in place of the adapter's, the total lands in the seed's 25-38 GB
    assert 25 * GB <= lora.total - lora.optimizer + full_8bit.optimizer <= 38 * GB
    # as LoRA actually trains, the 7B run needs ~21 GB
    assert 19 * GB <= lora.total <= 23 * GB


def test_70b_qlora_against_the_seeds_76_to_86_gb():
    seventy = cfg("llama-3.1-70b")
    common = dict(quantization="nf4", dtype="bfloat16", lora_rank=16, gradient_checkpointing=True, prompt_tokens=256)
    default = memory(seventy, **common, per_device_batch=8, completion_tokens=512)
    assert 55 * GB <= default.total <= 64 * GB  # 42.7 GB of 4-bit weights + 12.9 GB activations + the rest
    # the seed's range is what 16 sequences of 1024 tokens per micro-batch need: 34 GB of activations
    long = memory(seventy, **common, per_device_batch=16, completion_tokens=768)
    assert 76 * GB <= long.total <= 86 * GB


def test_quantization_orders_the_weights():
    sizes = [
        memory(cfg("qwen2.5-7b"), quantization=q, double_quant=dq).weights
        for q, dq in (("none", False), ("int8", False), ("nf4", False), ("nf4", True))
    ]
    assert sizes == sorted(sizes, reverse=True)
    assert memory(cfg("qwen2.5-7b"), dtype="float32").weights == pytest.approx(2 * sizes[0], abs=1)


def test_full_fine_tuning_and_reference_model():
    c = cfg("qwen2.5-0.5b")
    full = memory(c, lora_rank=0, beta=0.0)
    assert full.trainable_params == full.params and full.gradients == full.weights
    assert memory(c, lora_rank=0, beta=0.04).reference == full.weights
    assert memory(c, lora_rank=16, beta=0.04).reference == 0  # the adapter-disabled base is the reference
    with pytest.raises(PlanError, match="quantized"):
        memory(c, lora_rank=0, quantization="nf4")


def test_vllm_share_replaces_the_transformers_kv_cache():
    c = cfg("qwen2.5-7b")
    hf, vl = memory(c), memory(c, vllm=True)
    assert vl.kv_cache == 0 and hf.kv_cache > 0
    assert vl.vllm > hf.weights  # its own copy of the weights, the KV pool and ~1 GiB of graphs


def test_sharding_divides_persistent_state():
    c = cfg("llama-3.1-70b")
    one, four = memory(c, quantization="nf4"), memory(c, quantization="nf4", shards=4)
    assert four.weights == pytest.approx(one.weights / 4, rel=1e-6) and four.activations == one.activations


# --- monotonic properties

SETTINGS = dict(
    rank=st.integers(1, 256),
    batch=st.integers(1, 64),
    prompt=st.integers(0, 4096),
    completion=st.integers(1, 4096),
    quant=st.sampled_from(["none", "nf4", "fp4", "int8"]),
    ckpt=st.booleans(),
    vllm=st.booleans(),
    model=st.sampled_from(sorted(KNOWN_MODELS)),
)


def _est(model, quant, rank, batch, prompt, completion, ckpt, vllm):
    return memory(
        cfg(model),
        quantization=quant,
        lora_rank=rank,
        per_device_batch=batch,
        prompt_tokens=prompt,
        completion_tokens=completion,
        gradient_checkpointing=ckpt,
        vllm=vllm,
    )


@settings(max_examples=150, deadline=None)
@given(**SETTINGS, more=st.integers(1, 64))
def test_more_rank_batch_or_context_never_lowers_memory(
    model, quant, rank, batch, prompt, completion, ckpt, vllm, more
):
    base = _est(model, quant, rank, batch, prompt, completion, ckpt, vllm).total
    assert _est(model, quant, rank + more, batch, prompt, completion, ckpt, vllm).total >= base
    assert _est(model, quant, rank, batch + more, prompt, completion, ckpt, vllm).total >= base
    assert _est(model, quant, rank, batch, prompt + more, completion, ckpt, vllm).total >= base
    assert _est(model, quant, rank, batch, prompt, completion + more, ckpt, vllm).total >= base


@settings(max_examples=150, deadline=None)
@given(**{k: v for k, v in SETTINGS.items() if k != "ckpt"})
def test_gradient_checkpointing_never_raises_memory(model, quant, rank, batch, prompt, completion, vllm):
    on = _est(model, quant, rank, batch, prompt, completion, True, vllm)
    off = _est(model, quant, rank, batch, prompt, completion, False, vllm)
    assert on.total <= off.total and on.activations <= off.activations


@settings(max_examples=100, deadline=None)
@given(
    hidden_heads=st.sampled_from([(512, 8), (1024, 16), (2048, 16), (4096, 32)]),
    layers=st.integers(2, 96),
    kv=st.sampled_from([1, 2, 4, 8]),
    mult=st.integers(2, 6),
    vocab=st.integers(1000, 260000),
    rank=st.integers(1, 128),
    batch=st.integers(1, 32),
    tokens=st.integers(16, 8192),
)
def test_properties_hold_for_any_dense_architecture(hidden_heads, layers, kv, mult, vocab, rank, batch, tokens):
    hidden, heads = hidden_heads
    c = {
        "hidden_size": hidden,
        "intermediate_size": hidden * mult,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
    }
    kw = dict(per_device_batch=batch, completion_tokens=tokens)
    assert (
        memory(c, gradient_checkpointing=True, lora_rank=rank, **kw).total
        <= memory(c, gradient_checkpointing=False, lora_rank=rank, **kw).total
    )
    assert memory(c, lora_rank=rank + 1, **kw).total >= memory(c, lora_rank=rank, **kw).total


# --- choosing a GPU


def test_plan_picks_the_cheapest_option_and_splits_the_batch():
    work = Workload(model="qwen2.5-7b", quantization="nf4", effective_batch=64, num_generations=8)
    plan = make_plan(cfg("qwen2.5-7b"), work)
    fitting = [o for o in plan.options if o.fits]
    assert plan.estimate.usd == min(o.usd for o in fitting)
    s = plan.settings
    assert s.per_device_train_batch_size * s.gradient_accumulation_steps * s.count == 64
    assert (s.per_device_train_batch_size * s.count * s.steps_per_generation) % 8 == 0
    assert plan.memory.total <= plan.options[[o.gpu for o in plan.options].index(s.gpu)].capacity_gib * GIB
    assert plan.estimate.spot_usd < plan.estimate.on_demand_usd and plan.estimate.pricing == "spot"
    assert plan.estimate.monthly_usd == pytest.approx(30 * plan.estimate.usd)


def test_plan_respects_allowed_gpus_and_shards_when_one_is_too_small():
    plan = make_plan(cfg("llama-3.1-70b"), Workload(model="llama-3.1-70b", dtype="bfloat16"), allowed=["L4"])
    assert plan.settings.gpu == "L4" and plan.settings.count > 1 and plan.settings.strategy == "fsdp"
    assert [o.gpu for o in plan.options] == ["L4"]
    # a 4-bit base is not sharded as the trainer loads it (plan = launch): replicated, it fits no L4
    with pytest.raises(PlanError, match="does not fit any allowed GPU"):
        make_plan(cfg("llama-3.1-70b"), Workload(model="llama-3.1-70b", quantization="nf4"), allowed=["L4"])


def test_nothing_fits_says_what_to_change():
    with pytest.raises(PlanError, match="needs at least .* GiB per GPU.*model.quantization=nf4"):
        make_plan(
            cfg("qwen2.5-72b"),
            Workload(model="qwen2.5-72b", lora_rank=0, optimizer="adamw_torch"),
            allowed=["A10G"],
            assumptions=Assumptions(max_gpus=1),
        )
    with pytest.raises(PlanError, match="multiple of num_generations"):
        make_plan(cfg("qwen2.5-0.5b"), Workload(model="x", effective_batch=20, num_generations=8))


def test_checkpointing_auto_turns_on_only_when_needed():
    small = make_plan(cfg("qwen2.5-0.5b"), Workload(model="q", completion_tokens=256), allowed=["H100"])
    assert small.settings.gradient_checkpointing is False
    big = make_plan(cfg("qwen2.5-7b"), Workload(model="q"), allowed=["A10G"])
    assert big.settings.gradient_checkpointing is True


def test_faster_gpus_take_less_time_and_h100_beats_a100_on_time():
    work = Workload(model="qwen2.5-7b", quantization="nf4")
    plan = make_plan(cfg("qwen2.5-7b"), work, allowed=["A100-80GB", "H100"])
    hours = {o.gpu: o.hours for o in plan.options}
    assert hours["H100"] < hours["A100-80GB"]


def test_budget_guard_refuses_with_the_estimate():
    plan = make_plan(cfg("qwen2.5-7b"), Workload(model="qwen2.5-7b", quantization="nf4", max_steps=2000))
    check_budget(plan, None)
    check_budget(plan, plan.estimate.usd + 0.01)
    with pytest.raises(BudgetExceeded, match=rf"\${plan.estimate.usd:,.2f} \(spot, 1x {plan.settings.gpu}"):
        check_budget(plan, plan.estimate.usd / 2)


def test_actual_cost_is_gpu_hours_times_the_chosen_price():
    c = cfg("qwen2.5-0.5b")
    spot = make_plan(c, Workload(model="q", max_steps=10), allowed=["A100-80GB"], spot=True)
    od = make_plan(c, Workload(model="q", max_steps=10), allowed=["A100-80GB"], spot=False)
    gpu = load_catalog().gpus["A100-80GB"]
    assert actual_cost(3.0, spot) == pytest.approx(3.0 * gpu.spot_usd_h)
    assert actual_cost(3.0, od) == pytest.approx(3.0 * gpu.on_demand_usd_h)
    assert actual_cost(None, od) == 0.0


def test_local_cpu_is_explicit_and_free():
    plan = plan_local(
        cfg("smollm2-135m"),
        Workload(model="s", dtype="float32", effective_batch=16),
        per_device_batch=16,
        gradient_accumulation=1,
        gradient_checkpointing=False,
    )
    assert plan.settings.gpu == "local-cpu" and plan.estimate.usd == 0 and plan.estimate.hours is None
    assert actual_cost(5.0, plan) == 0.0
    assert any("cost 0 USD" in n for n in plan.notes)


def test_catalog_override_merges_field_by_field(tmp_path):
    user = tmp_path / "gpus.yaml"
    user.write_text(
        "as_of: '2030-01'\ngpus:\n  H100: {spot_usd_h: 0.5}\n  MI300X: {memory_gib: 192, bf16_tflops: 1307,"
        " bandwidth_tbs: 5.3, on_demand_usd_h: 4.0, spot_usd_h: 2.0}\n"
    )
    catalog = load_catalog(user)
    assert catalog.as_of == "2030-01" and catalog.gpus["H100"].spot_usd_h == 0.5
    assert catalog.gpus["H100"].memory_gib == load_catalog().gpus["H100"].memory_gib
    assert catalog.get("mi300x").memory_gib == 192
    with pytest.raises(PlanError, match="not found"):
        load_catalog(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("gpus:\n  H100: {memory_gib: -1}\n")
    with pytest.raises(PlanError, match="invalid"):
        load_catalog(tmp_path / "bad.yaml")


# --- the pipeline config and the CLI


def test_plan_from_the_pipeline_config(tiny_config):
    from grpo_pipeline.tasks.plan import plan_for_config

    local = plan_for_config(*_sections(tiny_config()), cfg("smollm2-135m"), "smollm2-135m")
    assert local.settings.gpu == "local-cpu" and local.estimate.usd == 0
    sky = tiny_config(
        "train.launcher=sky",
        "model.compute_dtype=bfloat16",
        "train.grpo.max_steps=100",
        "train.sky.accelerators=[L4:1, A10G:1]",
        "plan.spot=false",
    )
    p = plan_for_config(sky.model, sky.train, sky.plan, cfg("qwen2.5-1.5b"), "qwen2.5-1.5b")
    assert p.settings.gpu in ("L4", "A10G") and p.estimate.pricing == "on-demand"
    assert {o.gpu for o in p.options} == {"L4", "A10G"}
    no_steps = tiny_config("train.launcher=sky")
    with pytest.raises(PlanError, match="max_steps"):
        plan_for_config(no_steps.model, no_steps.train, no_steps.plan, cfg("qwen2.5-1.5b"), "q")


HEAVY = ("torch", "transformers", "prefect", "trl")
# The command as a user's shell runs it, reporting which heavy packages it loaded on the way.
CLI = (
    "import json, sys; from typer.main import get_command; from grpo_pipeline.cli import app;"
    "rc = get_command(app).main(sys.argv[1:], standalone_mode=False) or 0;"
    f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})), file=sys.stderr);"
    "sys.exit(rc)"
)


def _cli(*args: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    proc = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, cwd=cwd)
    return proc, json.loads(proc.stderr.strip().splitlines()[-1]) if proc.returncode == 0 else None


@pytest.mark.parametrize(
    "args",
    [
        ("--model", "qwen2.5-7b", "--quant", "nf4"),
        ("--model", "meta-llama/Llama-3.1-70B-Instruct", "--quant", "nf4", "--lora-rank", "16"),
        ("--config", "configs/demo-cpu.yaml"),
        ("--config", "configs/qwen2.5-7b-qlora.yaml", "--set", "train.launcher=sky"),
    ],
    ids=["7b", "70b", "demo-config", "7b-recipe-sky"],
)
def test_cli_plan_loads_neither_torch_transformers_nor_prefect(args):
    proc, heavy = _cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    assert heavy == []
    out = json.loads(proc.stdout)
    assert out["settings"]["gpu"] and out["memory_gib"]["total"] > 0.1


def test_cli_config_loads_neither_torch_nor_transformers():
    proc, heavy = _cli("config")
    assert proc.returncode == 0, proc.stderr
    assert not [m for m in heavy if m.split(".")[0] in ("torch", "transformers")]
    assert json.loads(proc.stdout)["model"]["base"]


def test_cli_finds_a_shipped_recipe_outside_a_checkout(tmp_path):
    proc, _ = _cli("plan", "--config", "configs/demo-cpu.yaml", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["model"] == "smollm2-135m"


def test_cli_plan_options_are_the_workload_fields():
    from typer.main import get_command

    from grpo_pipeline.cli import app

    params = {p.name: p for p in get_command(app).commands["plan"].params}
    fields = set(Workload.model_fields) - {"model"}  # --model names the model to read, not its display name
    assert fields <= set(params)
    for name in fields:
        assert params[name].default == Workload.model_fields[name].default, name
        assert params[name].help == Workload.model_fields[name].description, name


def test_workload_defaults_are_trls_own():
    trl = {
        "num_generations": "num_generations",
        "completion_tokens": "max_completion_length",
        "optimizer": "optim",
        "beta": "beta",
        "vllm": "use_vllm",
    }
    for field, name in trl.items():
        assert Workload.model_fields[field].default == default("GRPOConfig", name), field


def test_unset_grpo_and_lora_fields_plan_what_trl_and_peft_run():
    from grpo_pipeline.configs.schema import load_config

    work = workload_for(
        *_sections(load_config(None, ["train.grpo={}", "train.lora={}", "plan.prompt_tokens=100"])),
        "m",
        train_rows=1000,
    )
    grpo = lambda name: default("GRPOConfig", name)  # noqa: E731
    assert (work.num_generations, work.completion_tokens, work.optimizer, work.beta, work.vllm) == (
        grpo("num_generations"),
        grpo("max_completion_length"),
        grpo("optim"),
        grpo("beta"),
        grpo("use_vllm"),
    )
    assert work.effective_batch == grpo("per_device_train_batch_size") * grpo("gradient_accumulation_steps")
    prompts_per_step = work.effective_batch / work.num_generations
    assert work.max_steps == -(-grpo("num_train_epochs") * 1000 // prompts_per_step)  # epochs over the rows
    assert (work.lora_rank, work.lora_targets) == (default("LoraConfig", "r"), default("LoraConfig", "target_modules"))


def test_peft_default_targets_are_peft_s_for_every_shipped_model():
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT

    for name in KNOWN_MODELS:
        assert tuple(PEFT[cfg(name)["model_type"]]) == PEFT_DEFAULT_TARGETS, name


def test_cli_plan_refuses_bad_input_and_budget_with_exit_2():
    from typer.testing import CliRunner

    from grpo_pipeline.cli import app

    runner = CliRunner()
    unknown = runner.invoke(app, ["plan", "--model", "org/nope"])
    assert unknown.exit_code == 2 and "config.json" in unknown.output
    over = runner.invoke(app, ["plan", "--model", "qwen2.5-7b", "--budget", "0.5"])
    assert over.exit_code == 2 and "exceeds plan.budget_usd = $0.50" in over.output
    table = runner.invoke(app, ["plan", "--model", "qwen2.5-7b", "--quant", "nf4", "--gpus", "H100"])
    assert table.exit_code == 0 and "activations" in table.output and "H100" in table.output


GROUPS = ["model.base=qwen2.5-0.5b", "train.launcher=sky", "train.grpo.max_steps=10", "train.grpo.num_generations=8"]


def test_a_batch_trl_refuses_at_start_is_refused_at_plan_time_naming_the_fields(tmp_path):
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import plan_for_config

    batch = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "steps_per_generation": 1}
    config = load_config(None, GROUPS + [f"train.grpo.{k}={v}" for k, v in batch.items()])  # no process count fixed yet
    trl = pytest.importorskip("trl")
    with pytest.raises(ValueError, match="must be divisible by num_generations"):  # TRL itself, one process, at start
        trl.GRPOConfig(output_dir=str(tmp_path), num_generations=8, use_cpu=True, **batch)
    with pytest.raises(
        PlanError,
        match=r"TRL's check at start.*per_device_train_batch_size x processes x "
        r"steps_per_generation = 4 x 1 x 1 = 4 .*num_generations \(8\)",
    ) as refused:
        plan_for_config(config.model, config.train, config.plan, cfg("qwen2.5-0.5b"), "q")
    assert "train.grpo.per_device_train_batch_size" in str(refused.value)
    assert "train.distributed.nodes / processes_per_node" in str(refused.value)


SERVER_MODE = ["train.grpo.use_vllm=true", "train.grpo.vllm_mode=server"]


@pytest.mark.parametrize(
    "generations,target,more", [(4, 8, []), (8, 16, []), (16, 16, []), (8, 8, SERVER_MODE), (16, 32, SERVER_MODE)]
)
def test_every_multi_gpu_plan_passes_the_launchers_batch_check(generations, target, more, tmp_path):
    """The search picks per-device batch and steps_per_generation for the world size it chose, so the node's own
    pre-launch check (TRL's rule with the process count) finds nothing in the planned job."""
    from grpo_pipeline.configs.schema import TrainConfig, load_config
    from grpo_pipeline.tasks.job import build_job_spec
    from grpo_pipeline.tasks.plan import apply_plan, plan_for_config
    from grpo_pipeline.trainer.distributed import problems

    config = load_config(
        None,
        [
            "model.base=llama-3.1-70b",
            "model.compute_dtype=bfloat16",
            "train.launcher=sky",
            "train.checkpoint_uri=s3://b/p",
            "train.grpo={}",
            "train.grpo.max_steps=10",
            f"train.grpo.num_generations={generations}",
            f"plan.target_effective_batch={target}",
            *more,
        ],
    )
    plan = plan_for_config(config.model, config.train, config.plan, cfg("llama-3.1-70b"), "m")
    s = plan.settings
    assert s.world_size > 1 and bool(s.vllm_server_gpus) == bool(more)  # the server's GPUs are not in the world
    planned = apply_plan(config, plan)
    TrainConfig.model_validate(planned.train.model_dump())
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1", "answer": "1"}\n')
    spec = build_job_spec(planned.train, planned.model, "m", {"train": data, "val": data}, tmp_path / "run")
    assert problems(spec, s.count) == []
    # and the time spreads one step's completions over the training processes only
    assert s.per_device_train_batch_size * s.gradient_accumulation_steps * s.world_size == target


def test_server_gpus_do_not_share_the_training_work():
    from grpo_pipeline.tasks.plan import Settings, step_seconds

    model, gpu = cfg("llama-3.1-8b"), load_catalog().get("H100")
    work = Workload(model="m", vllm=True, effective_batch=16)
    common = dict(
        gpu="H100",
        strategy="ddp",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        gradient_checkpointing=True,
        bf16=True,
    )
    two = Settings(count=2, processes_per_node=2, **common)
    two_and_server = Settings(count=4, processes_per_node=2, vllm_server_gpus=2, vllm_tensor_parallel=2, **common)
    four = Settings(
        count=4, processes_per_node=4, **{**common, "gradient_accumulation_steps": 1, "steps_per_generation": 1}
    )
    train2, _ = step_seconds(model, work, two, gpu, Assumptions())
    train2s, gen2s = step_seconds(model, work, two_and_server, gpu, Assumptions())
    train4, _ = step_seconds(model, work, four, gpu, Assumptions())
    assert train2s == pytest.approx(train2) and train4 < train2  # only trainers divide the step's completions
    assert gen2s > 0 and (two_and_server.gpus, two_and_server.world_size) == (4, 2)


def test_a_local_run_of_two_processes_plans_each_process_at_its_configured_batch():
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import plan_for_config

    one, two = (load_config(None, sets) for sets in ([], ["train.distributed.processes_per_node=2"]))
    p1, p2 = (plan_for_config(c.model, c.train, c.plan, cfg("smollm2-135m"), "smollm2-135m") for c in (one, two))
    assert p2.workload.effective_batch == 2 * p1.workload.effective_batch  # TRL runs the batch on each process
    split = lambda p: (p.settings.per_device_train_batch_size, p.settings.gradient_accumulation_steps)  # noqa: E731
    assert split(p2) == split(p1) and p2.memory.total == p1.memory.total


def test_a_pinned_layout_that_cannot_run_says_why_not_a_memory_figure():
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import plan_for_config

    sets = [
        "model.base=llama-3.1-70b",
        "model.compute_dtype=bfloat16",
        "train.launcher=sky",
        "train.grpo.max_steps=10",
        "train.grpo.use_vllm=true",
        "train.distributed.strategy=fsdp",
    ]
    with pytest.raises(PlanError, match="cannot be planned as configured: .*colocated vLLM needs the whole model"):
        plan_for_config(*_sections(load_config(None, sets)), cfg("llama-3.1-70b"), "m")
    served = plan_for_config(
        *_sections(load_config(None, sets + ["train.grpo.vllm_mode=server"])), cfg("llama-3.1-70b"), "m"
    )
    assert served.settings.strategy == "fsdp" and served.settings.vllm_tensor_parallel > 0


def test_a_gpu_too_small_for_the_model_is_refused_for_memory_not_for_a_strategy_it_cannot_use():
    """Once a memory estimate was made, it is the reason: the strategies skipped without one (fsdp of a 4-bit
    base) do not overwrite it."""
    work = Workload(model="llama-3.1-70b", quantization="nf4")
    plan = make_plan(cfg("llama-3.1-70b"), work)
    l4 = next(o for o in plan.options if o.gpu == "L4")
    assert not l4.fits and l4.refused == "memory"
    assert (
        l4.note
        == f"needs {l4.need_gib:.1f} GiB per training GPU at the smallest settings, {l4.capacity_gib:.1f} GiB usable"
    )
    assert l4.need_gib > 40 and l4.capacity_gib < 22
    with pytest.raises(PlanError, match=r"needs at least 42\.9 GiB per GPU\. lower the LoRA") as refused:
        make_plan(cfg("llama-3.1-70b"), work, allowed=["L4"])
    assert "model.quantization=nf4" not in str(refused.value)  # the base is nf4 already


RECIPE_SERVER = ["train.launcher=sky", "train.grpo.vllm_mode=server", "train.distributed.vllm_server_gpus=2"]


def test_fixed_server_gpus_add_their_count_to_the_trainers_counts_tried():
    """The 0.5B recipe fixes per device 8 x accumulation 4 (one process's batch); with 2 server GPUs only a node of
    1 + 2 runs it. Before, 3 was never tried and the plan blamed the 2-GPU node ('0 processes + 2 vLLM server GPUs')."""
    from grpo_pipeline.configs.files import packaged
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import plan_for_config

    config = load_config(packaged("gsm8k-qwen2.5-0.5b.yaml"), RECIPE_SERVER)
    s = plan_for_config(config.model, config.train, config.plan, cfg("qwen2.5-0.5b"), "q").settings
    assert (s.count, s.processes_per_node, s.vllm_server_gpus, s.world_size) == (3, 1, 2, 1)
    assert s.per_device_train_batch_size * s.gradient_accumulation_steps == 32
    # such a node is a fallback: when a power of two runs the job it is chosen, though 3 GPUs would cost less
    big = [
        "model.base=qwen2.5-32b",
        "model.compute_dtype=bfloat16",
        "train.launcher=sky",
        "train.grpo.max_steps=10",
        "train.grpo.use_vllm=true",
        "plan.target_effective_batch=64",
        "plan.allowed_gpus=[H100]",
        *RECIPE_SERVER[1:],
    ]
    plan = plan_for_config(*_sections(load_config(None, big)), cfg("qwen2.5-32b"), "q")
    assert (plan.settings.count, plan.settings.processes_per_node) == (4, 2)
    # and when nothing runs the batch, the batch is the reason, not the nodes too small for the server
    with pytest.raises(
        PlanError,
        match=r"no launch of this batch passes TRL's check at start: H100: "
        r"per_device_train_batch_size x processes x steps_per_generation = 8 x 1 x 1",
    ):
        plan_for_config(
            *_sections(
                load_config(
                    packaged("gsm8k-qwen2.5-0.5b.yaml"),
                    RECIPE_SERVER
                    + [
                        "train.grpo.steps_per_generation=1",
                        "train.grpo.num_generations=16",
                        "plan.allowed_gpus=[H100]",
                    ],
                )
            ),
            cfg("qwen2.5-0.5b"),
            "q",
        )


def test_reasons_are_typed_by_kind():
    from grpo_pipeline.configs.layout import DistributedConfig
    from grpo_pipeline.tasks.plan import Layout
    from grpo_pipeline.tasks.plan.fit import fit

    h100, model = load_catalog().get("H100"), cfg("qwen2.5-0.5b")
    served = Workload(model="q", vllm=True, effective_batch=16)
    # a node of one GPU cannot hold a server and a trainer: that, not the batch, is why
    settings, mem, _, why = fit(model, served, h100, 1, Assumptions(), Layout(vllm_server=True))
    assert settings is None and mem is None and why.kind == "layout"
    assert why.text.startswith("a vLLM server (vllm_mode=server) needs GPUs of its own, and 1 GPU per node leaves none")
    _, _, _, why = fit(
        model,
        served,
        h100,
        2,
        Assumptions(),
        Layout(vllm_server=True, distributed=DistributedConfig(vllm_server_gpus=2)),
    )
    assert why.kind == "layout" and "leave no GPU to train on" in why.text
    _, _, _, why = fit(
        model, Workload(model="q", effective_batch=16), h100, 4, Assumptions(), Layout(per_device_train_batch_size=16)
    )
    assert why.kind == "batch" and "cannot make the effective batch of 16" in why.text
    _, mem, _, why = fit(cfg("qwen2.5-72b"), Workload(model="q"), load_catalog().get("L4"), 1, Assumptions())
    assert why.kind == "memory" and mem.total > 22 * GIB
    with pytest.raises(PlanError, match="cannot be planned as configured: H100: a vLLM server"):
        make_plan(model, served, allowed=["H100"], layout=Layout(vllm_server=True, gpus_per_node={"H100": 1}))


def test_the_summary_says_what_each_gpu_count_counts():
    from grpo_pipeline.configs.files import packaged
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import plan_run
    from grpo_pipeline.tasks.select import price

    config = load_config(packaged("gsm8k-llama-3.1-70b.yaml"))
    plan = plan_run(config.model, config.train, config.plan)
    s, summary = plan.settings, plan.summary()
    assert s.nodes > 1 and s.vllm_server_node  # the server's node is one of them
    assert (summary["plan_gpus_total"], summary["plan_gpus_per_node"], summary["plan_nodes"]) == (
        s.nodes * s.count,
        s.count,
        s.nodes,
    )
    assert summary["plan_world_size"] == (s.nodes - 1) * s.processes_per_node
    assert plan.estimate.gpu_hours == pytest.approx(plan.estimate.hours * summary["plan_gpus_total"])
    row = price(config.model, config.train, config.plan, "unused")
    assert (row.gpu, row.gpus_total) == (s.gpu, summary["plan_gpus_total"])


def test_the_plan_stage_reuses_preflights_plan_only_for_a_model_that_plans_the_same(tmp_path):
    """With a budget, preflight prices the configured base from its shipped config.json; the plan stage, given
    the resolved model, answers with that plan when the model's name and architecture are the same (one plan per
    run), and plans again for a model that differs."""
    from grpo_pipeline.configs.schema import load_config
    from grpo_pipeline.tasks.plan import load_model_config, plan_run

    cfg = load_config(None, ["model.base=qwen2.5-0.5b", "train.launcher=sky", "train.grpo.max_steps=10"])
    priced = plan_run(cfg.model, cfg.train, cfg.plan)
    shipped = load_model_config("qwen2.5-0.5b")[1]
    same, deeper = tmp_path / "same", tmp_path / "deeper"
    for folder, config in (
        (same, shipped),
        (deeper, {**shipped, "num_hidden_layers": 4 * shipped["num_hidden_layers"]}),
    ):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert plan_run(cfg.model, cfg.train, cfg.plan, str(same), priced=priced) is priced
    replanned = plan_run(cfg.model, cfg.train, cfg.plan, str(deeper), priced=priced)
    assert replanned.params > priced.params
    assert plan_run(cfg.model, cfg.train, cfg.plan, str(same), train_rows=100, priced=priced) is not priced
