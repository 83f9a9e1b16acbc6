"""Which precision a job trains in: bf16 where the hardware has it, float32 elsewhere, and a bf16 request on a
CPU without native bf16 refused before any work (it would run about 50x slower than float32)."""

import pytest

from grpo_pipeline.trainer import precision
from grpo_pipeline.trainer.precision import cpu_flags, cpu_has_native_bf16, default_bf16, slow_bf16_reason


@pytest.mark.parametrize(
    "flags, native",
    [
        ("fpu sse avx avx2 fma avx512f avx512_bf16", True),  # Zen 4, Cooper Lake
        ("fpu sse avx avx2 avx512f amx_tile amx_bf16", True),  # Sapphire Rapids
        ("fpu sse avx avx2 fma avx512f avx512bw", False),  # AVX-512 without its bf16 extension: emulated
        ("fpu sse avx avx2 fma", False),  # Zen 3: the machine these tests were written on
    ],
)
def test_native_bf16_is_read_from_the_cpus_flags(tmp_path, flags, native):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_has_native_bf16(cpu_flags(info)) is native


def test_unreadable_cpuinfo_means_float32(tmp_path):
    assert cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu_has_native_bf16(frozenset()) is False


@pytest.mark.parametrize(
    "cuda, cuda_bf16, cpu_native, expected",
    [
        (False, False, True, True),  # a CPU with native bf16: on by default
        (False, False, False, False),  # a CPU without: float32
        (True, True, False, True),  # an A100 / H100 / L4
        (True, False, True, False),  # a T4 / V100: the GPU decides, not the host's CPU
    ],
)
def test_the_default_follows_the_device_that_computes(cuda, cuda_bf16, cpu_native, expected):
    assert default_bf16(cuda, cuda_bf16, cpu_native) is expected


def test_asking_bf16_on_a_cpu_without_it_names_the_flag_and_the_fallback():
    reason = slow_bf16_reason(True, cuda=False, cpu_native_bf16=False)
    assert "train.grpo.bf16" in reason and "50x slower" in reason and "set it to false" in reason
    assert slow_bf16_reason(True, cuda=True, cpu_native_bf16=False) is None
    assert slow_bf16_reason(False, cuda=False, cpu_native_bf16=False) is None


def test_the_job_refuses_slow_bf16_before_any_work(tmp_path, monkeypatch, capsys, tiny_config):
    from grpo_pipeline.tasks.job import model_load, train_settings
    from grpo_pipeline.trainer.spec import BAD_INPUT_TAG, EXIT_BAD_INPUT, JobSpec
    from grpo_pipeline.trainer.train import main

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setattr(precision.platform, "machine", lambda: "x86_64")
    cfg = tiny_config("train.grpo.bf16=true")
    spec = JobSpec(
        model_path=str(tmp_path / "no-model"),
        model=model_load(cfg.model),
        train=train_settings(cfg.train),
        train_file=str(tmp_path / "train.jsonl"),
        work_dir=str(tmp_path / "work"),
        checkpoint_uri=str(tmp_path / "ckpt"),
        adapter_dir=str(tmp_path / "adapter"),
    )
    assert main(str(spec.write(tmp_path / "job.json"))) == EXIT_BAD_INPUT
    out = capsys.readouterr().out
    assert BAD_INPUT_TAG in out and "train.grpo.bf16=true on a CPU without native bfloat16" in out
    assert not (tmp_path / "work").exists() and not (tmp_path / "ckpt").exists()
