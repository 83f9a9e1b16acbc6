"""The portable champion: the base as something anyone can load, the adapter (and the merged model) as MLflow
models, and the serving check that proves a registered version loads and generates with none of this code.

- `base_reference`: a hub id stays a hub id; a local base (the demo's converted GGUF, a directory) is copied
  into the artifact store once per content hash (a run in the experiment `BASE_EXPERIMENT` tagged
  `base_sha256`) and named by that run's URI, `runs:/<id>/model`, from then on.
- `log_adapter_model` / `log_merged_model`: MLflow models from code (`tasks/promote/serving_model.py`, which imports
  only mlflow, transformers, peft and torch) with the adapter, whose `adapter_config.json` names the base
  reference, the tokenizer and chat template, an input example and a signature.
- `serving_check`: a fresh Python process, its working directory outside the project, this project's
  packages unimportable, loads `models:/<name>/<version>` and generates for holdout prompts (given on its
  stdin, of any size); the outputs must equal the evaluation's greedy outputs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:  # MLflow and the config loaded lazily: a lookup of the module stays light
    from mlflow import MlflowClient
    from mlflow.entities import LoggedModel
    from mlflow.models import ModelSignature
    from mlflow.models.model import ModelInfo

    from grpo_pipeline.configs.schema import EvalConfig, ModelConfig

from types import SimpleNamespace

from grpo_pipeline.tasks.chat_prompts import prompt_text  # the served model's input; re-exported for the flow

MODEL_CODE = Path(__file__).with_name("serving_model.py")
RENDERER_CODE = Path(__file__).parents[1] / "chat_prompts.py"  # shipped with it: the evaluation's renderer
BASE_EXPERIMENT = "grpo-base-models"
BASE_TAG = "base_sha256"
PROJECT_PACKAGES = ("configs", "trainer", "tasks", "infra", "flows", "grpo_pipeline", "bench", "tests")


class BaseRef(BaseModel):
    """What a model version names as its base."""

    reference: str  # a hub id, or runs:/<id>/model (the copy in the artifact store)
    sha256: str | None = None  # of the local base's files, when it was copied
    uploaded: bool = False  # this call made the copy (False: an earlier run had)


class ServingCheck(BaseModel):
    model_uri: str
    prompts: int
    matched: int
    passed: bool
    seconds: float
    mismatches: list[dict] = []  # {"key", "expected", "served"} for the first few
    error: str | None = None  # the process's failure, when it did not answer

    def reason(self) -> str:
        if self.error:
            return f"serving check: {self.model_uri} did not load or generate outside the project ({self.error})"
        return (
            f"serving check: {self.model_uri} served {self.matched}/{self.prompts} holdout prompts as "
            "the evaluation generated them"
        )


# ------------------------------------------------------------------------------------------------ the base


def content_hash(directory: Path) -> str:
    """sha256 over the directory's file names and contents, in name order (hidden files left out)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if any(part.startswith(".") for part in relative.split("/")):
            continue
        digest.update(relative.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def base_reference(client: MlflowClient, model_path: str, experiment_id: str, label: str) -> BaseRef:
    """The base as others can load it: a hub id as it is; a local directory copied once per content hash."""
    if not Path(model_path).is_dir():
        return BaseRef(reference=model_path)  # a hub id: from_pretrained loads it anywhere
    sha = content_hash(Path(model_path))
    found = client.search_runs(
        [experiment_id], f"tags.{BASE_TAG} = '{sha}' and attributes.status = 'FINISHED'", max_results=1
    )
    if found:
        return BaseRef(reference=f"runs:/{found[0].info.run_id}/model", sha256=sha)
    run = client.create_run(experiment_id, run_name=f"{label}-{sha[:12]}", tags={"base_label": label})
    client.log_artifacts(run.info.run_id, model_path, "model")
    # The tag marks a complete copy: set only after the upload, so a half-uploaded copy is never used.
    client.set_tag(run.info.run_id, BASE_TAG, sha)
    client.set_terminated(run.info.run_id)
    return BaseRef(reference=f"runs:/{run.info.run_id}/model", sha256=sha, uploaded=True)


def portable_adapter(adapter_dir: str, base: BaseRef, dst: Path) -> Path:
    """A copy of the adapter whose `adapter_config.json` names the portable base, not a path on this machine."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(adapter_dir, dst)
    config_path = dst / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base.reference
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
    return dst


# ------------------------------------------------------------------------------------------------ MLflow models


def _requirements(quantized: bool) -> list[str]:
    """Pinned to what trained here; listed, so MLflow does not load the model to infer them."""
    names = ["mlflow", "transformers", "peft", "torch", "accelerate", *(["bitsandbytes"] if quantized else [])]
    return [f"{n}=={metadata.version(n)}" for n in names if _installed(n)]


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def _signature(max_new_tokens: int, batch_size: int) -> ModelSignature:
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string", "prompt")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema(
            [ParamSpec("max_new_tokens", "long", max_new_tokens), ParamSpec("batch_size", "long", batch_size)]
        ),
    )


def _log(name: str, artifacts: dict[str, str], model_config: dict, example: str, tags: dict) -> ModelInfo:
    """Log a model from code into the active run.

    With an input example, MLflow loads the model in this process and predicts on the example before
    uploading it (downloading the base, loading it, generating); `validate_serving_input=False` skips that,
    and the serving check does it properly, in a clean process. `pyfunc.log_model` does not pass that option
    on, so `Model.log` is called with pyfunc's `save_model` minus the option.
    """
    import mlflow
    import pandas as pd

    def save_model(validate_serving_input=True, **kwargs):
        return mlflow.pyfunc.save_model(**kwargs)

    flavor = SimpleNamespace(__name__=mlflow.pyfunc.__name__, save_model=save_model)
    return mlflow.models.Model.log(
        artifact_path=None,
        name=name,
        flavor=flavor,
        flavor_name="pyfunc.ModelFromCode",
        python_model=str(MODEL_CODE),
        code_paths=[str(RENDERER_CODE)],
        artifacts=artifacts,
        model_config=model_config,
        signature=_signature(model_config["max_new_tokens"], model_config["batch_size"]),
        input_example=pd.DataFrame({"prompt": [example]}),
        pip_requirements=_requirements(model_config.get("quantization", "none") != "none"),
        validate_serving_input=False,
        tags=tags,
    )


def find_logged_model(run_id: str, name: str) -> LoggedModel | None:
    """The model a first attempt of this run logged, so a retry registers it instead of logging again."""
    import mlflow

    found = mlflow.search_logged_models(
        filter_string=f"source_run_id = '{run_id}' AND name = '{name}'", output_format="list", max_results=1
    )
    return found[0] if found else None


def model_config(base: BaseRef | None, model: ModelConfig, evaluate: EvalConfig) -> dict:
    """How the model code loads and generates: base, precision, and the evaluation's decoding."""
    out: dict[str, Any] = {
        "max_new_tokens": evaluate.max_new_tokens,
        "batch_size": evaluate.batch_size,
        "trust_remote_code": model.trust_remote_code,
        "compute_dtype": model.compute_dtype,
    }
    if base is not None:
        out |= {
            "base": base.reference,
            "base_sha256": base.sha256,
            "quantization": model.quantization,
            "double_quant": model.double_quant,
        }
    return out


def log_adapter_model(
    adapter_dir: str, base: BaseRef, model: ModelConfig, evaluate: EvalConfig, example: str, work: Path
) -> tuple[str, str]:
    """The adapter as an MLflow model in the active run; returns (model URI, logged model id)."""
    portable = portable_adapter(adapter_dir, base, work / "adapter")
    info = _log(
        "adapter",
        {"adapter": str(portable)},
        model_config(base, model, evaluate),
        example,
        {"base_model": base.reference},
    )
    return info.model_uri, info.model_id


def log_merged_model(merged_dir: str, model: ModelConfig, evaluate: EvalConfig, example: str) -> tuple[str, str]:
    """The merged model (full weights, its tokenizer) as an MLflow model in the active run."""
    info = _log("merged", {"merged": merged_dir}, model_config(None, model, evaluate), example, {})
    return info.model_uri, info.model_id


# ------------------------------------------------------------------------------------------------ the check

BLOCKER = '''"""Installed by the serving check: this project's packages cannot be imported here."""
import sys

BLOCKED = set(%r)


class _NoProjectImports:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name}: the project is not importable where the model is served")
        return None


sys.meta_path.insert(0, _NoProjectImports())
'''

CHECK = r"""
import json, sys
import mlflow
import pandas as pd

args = json.loads(sys.stdin.read())
mlflow.set_tracking_uri(args["tracking_uri"])
model = mlflow.pyfunc.load_model(args["model_uri"])
out = model.predict(pd.DataFrame({"prompt": args["prompts"]}),
                    params={"max_new_tokens": args["max_new_tokens"], "batch_size": args["batch_size"]})
print(json.dumps({"outputs": [str(o) for o in out], "cwd": __import__("os").getcwd()}))
"""


def isolated_env(tracking_uri: str, workdir: Path, cache_dir: Path | None = None) -> dict[str, str]:
    """The environment of a process that must not see the project: PYTHONPATH holds only a hook that refuses
    its packages (an editable install would otherwise find them), MLflow's URI, no progress bars."""
    hook = workdir / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(BLOCKER % (PROJECT_PACKAGES,))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "GRPO_"))}
    env |= {
        "PYTHONPATH": str(hook),
        "MLFLOW_TRACKING_URI": tracking_uri,
        "PYTHONNOUSERSITE": "1",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cache_dir is not None:
        env["GRPO_MODEL_CACHE"] = str(cache_dir)
    return env


def serving_check(
    model_uri: str,
    tracking_uri: str,
    rows: list[dict],
    expected: list[str],
    max_new_tokens: int,
    batch_size: int,
    cache_dir: Path | None = None,
    timeout_s: float = 1800,
) -> ServingCheck:
    """Load `model_uri` in a clean process outside the project and compare its outputs with `expected`
    (the evaluation's greedy completions of the same holdout rows, in the same batches)."""
    started = time.monotonic()
    prompts = [prompt_text(r["prompt"]) for r in rows]
    with tempfile.TemporaryDirectory(prefix="grpo-serving-check-") as tmp:
        payload = json.dumps(
            {
                "tracking_uri": tracking_uri,
                "model_uri": model_uri,
                "prompts": prompts,
                "max_new_tokens": max_new_tokens,
                "batch_size": batch_size,
            }
        )
        # On stdin, not argv: one argument is capped at 128 KiB (a long holdout failed with E2BIG), and argv
        # shows in `ps` to every user of the machine.
        proc = subprocess.run(
            [sys.executable, "-c", CHECK],
            input=payload,
            cwd=tmp,
            capture_output=True,
            text=True,
            env=isolated_env(tracking_uri, Path(tmp), cache_dir),
            timeout=timeout_s,
        )
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return ServingCheck(
            model_uri=model_uri, prompts=len(rows), matched=0, passed=False, seconds=seconds, error=tail[0][:500]
        )
    served = json.loads(proc.stdout.strip().splitlines()[-1])["outputs"]
    mismatches = [
        {"key": r.get("key", i), "expected": e, "served": s}
        for i, (r, e, s) in enumerate(zip(rows, expected, served, strict=True))
        if e != s
    ]
    return ServingCheck(
        model_uri=model_uri,
        prompts=len(rows),
        matched=len(rows) - len(mismatches),
        passed=not mismatches,
        seconds=seconds,
        mismatches=mismatches[:5],
    )
