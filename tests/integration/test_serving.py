"""The portable champion against a real MLflow server (PostgreSQL, artifacts on S3): the base copied once per
content hash, the adapter as an MLflow model whose adapter_config.json names that copy, loaded by
`models:/<name>@champion` in a process outside the project that cannot import it, generating what the
evaluation generates; and `mlflow models serve` answering on 127.0.0.1."""

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlflow
import pytest

from grpo_pipeline.configs.schema import load_config
from grpo_pipeline.tasks.promote import serving
from grpo_pipeline.tasks.promote.registry import CHAMPION, AliasMove, Registry
from grpo_pipeline.trainer.launch import free_port

pytestmark = pytest.mark.integration

ROWS = [
    {"key": f"k{i}", "prompt": [{"role": "user", "content": f"What is {i} + 2? Reply with just the number."}]}
    for i in range(4)
]


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory) -> Path:
    """A LoRA adapter with non-zero weights (so it changes the outputs) and the tokenizer, as the trainer saves it."""
    from peft import LoraConfig, get_peft_model

    from grpo_pipeline.trainer.loading import load_model
    from grpo_pipeline.trainer.spec import ModelLoad

    model, tokenizer = load_model(
        str(tiny_model),
        ModelLoad(quantization="none", double_quant=False, compute_dtype="float32", trust_remote_code=False),
    )
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    out = tmp_path_factory.mktemp("adapter")
    peft_model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def champion(mlflow_server_uri, tiny_model, adapter, tmp_path_factory):
    """The adapter logged as an MLflow model, registered, and made champion; with the evaluation's outputs."""
    from grpo_pipeline.tasks.evaluate import generate
    from grpo_pipeline.trainer.loading import load_model
    from grpo_pipeline.trainer.spec import ModelLoad

    cfg = load_config(None, ["evaluate.max_new_tokens=6", "evaluate.batch_size=4"])
    client = mlflow.MlflowClient(mlflow_server_uri)
    mlflow.set_tracking_uri(mlflow_server_uri)
    base_exp = (
        client.get_experiment_by_name(serving.BASE_EXPERIMENT)
        or client.get_experiment(client.create_experiment(serving.BASE_EXPERIMENT))
    ).experiment_id
    first = serving.base_reference(client, str(tiny_model), base_exp, "tiny")
    again = serving.base_reference(client, str(tiny_model), base_exp, "tiny")
    mlflow.set_experiment("serving-tests")
    with mlflow.start_run() as run:
        uri, model_id = serving.log_adapter_model(
            str(adapter),
            first,
            cfg.model,
            cfg.evaluate,
            serving.prompt_text(ROWS[0]["prompt"]),
            tmp_path_factory.mktemp("w"),
        )
    registry = Registry(client, "serving-adapter")
    version = registry.register(uri, run.info.run_id, {"base_model": first.reference}, model_id=model_id)
    registry.apply([AliasMove(CHAMPION, version)])
    model, tokenizer = load_model(
        str(tiny_model),
        ModelLoad(quantization="none", double_quant=False, compute_dtype="float32", trust_remote_code=False),
        adapter=str(adapter),
    )
    model.eval()
    expected, _ = generate(model, tokenizer, [r["prompt"] for r in ROWS], 6, 4)
    return {
        "first": first,
        "again": again,
        "registry": registry,
        "version": version,
        "expected": expected,
        "uri": mlflow_server_uri,
    }


def test_the_base_is_copied_once_and_the_adapter_names_the_copy(champion, tmp_path):
    first, again = champion["first"], champion["again"]
    assert first.reference.startswith("runs:/") and first.reference.endswith("/model")
    assert again.reference == first.reference and again.uploaded is False  # found by content hash, not re-uploaded
    local = mlflow.artifacts.download_artifacts(
        artifact_uri=f"models:/serving-adapter@{CHAMPION}", dst_path=str(tmp_path), tracking_uri=champion["uri"]
    )
    config = json.loads((Path(local) / "artifacts" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == first.reference
    assert (Path(local) / "input_example.json").is_file()
    assert (
        "chat_template" in (Path(local) / "artifacts" / "adapter" / "tokenizer_config.json").read_text()
        or (Path(local) / "artifacts" / "adapter" / "chat_template.jinja").is_file()
    )


def test_the_champion_loads_and_generates_outside_the_project_and_a_wrong_expectation_fails(champion, tmp_path):
    """`serving_check` runs a fresh interpreter in a temporary directory whose PYTHONPATH holds only a hook
    that refuses this project's packages. One check (one interpreter loading the model) shows both sides: given
    expectations that are all wrong it fails on every row, and what it reports as served, row by row, is what
    the evaluation generated. (The check that passes runs in every pipeline run: test_flow asserts it.)"""
    wrong = [e + " (not what was served)" for e in champion["expected"]]
    check = serving.serving_check(
        f"models:/serving-adapter@{CHAMPION}",
        champion["uri"],
        ROWS,
        wrong,
        max_new_tokens=6,
        batch_size=4,
        cache_dir=tmp_path / "cache",
    )
    assert check.error is None, check.error
    assert not check.passed and check.matched == 0 and check.prompts == len(ROWS)
    assert [m["key"] for m in check.mismatches] == [r["key"] for r in ROWS]
    assert [m["expected"] for m in check.mismatches] == wrong
    assert [m["served"] for m in check.mismatches] == champion["expected"]


def test_the_isolated_process_cannot_import_the_project(champion, tmp_path):
    env = serving.isolated_env(champion["uri"], tmp_path)
    assert str(Path(__file__).parents[2]) not in env["PYTHONPATH"]
    proc = subprocess.run(
        [sys.executable, "-c", "import grpo_pipeline.tasks.promote.registry"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "not importable where the model is served" in proc.stderr


@pytest.mark.slow  # make test-slow: MLflow's own scoring server starts in a fresh environment (52 s)
def test_mlflow_models_serve_answers_on_loopback(champion, tmp_path):
    port = free_port()
    env = serving.isolated_env(champion["uri"], tmp_path, cache_dir=tmp_path / "cache")
    # MLflow starts the scoring server as `uvicorn` from PATH: the environment's bin, as in an activated venv
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    mlflow_cli = str(Path(sys.executable).parent / "mlflow")
    server = subprocess.Popen(
        [
            mlflow_cli,
            "models",
            "serve",
            "-m",
            f"models:/serving-adapter@{CHAMPION}",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
            "--env-manager",
            "local",
            "-w",
            "1",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600  # loading torch and the model on a busy machine
        while True:
            assert server.poll() is None, server.stdout.read()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the scoring server did not come up"
                time.sleep(1)
        texts = [serving.prompt_text(r["prompt"]) for r in ROWS]
        # The scoring server's shapes the registered signature lets through, each answered as the evaluation
        # generated (`{"inputs": {"prompt": [...]}}` crashed in the chat template before the model expanded it)
        for data in (
            {"dataframe_records": [{"prompt": t} for t in texts]},
            {"dataframe_split": {"columns": ["prompt"], "data": [[t] for t in texts]}},
            {"inputs": {"prompt": texts}},
            {"inputs": texts},
            {"instances": texts},
        ):
            body = json.dumps(data | {"params": {"max_new_tokens": 6, "batch_size": 4}}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=300) as response:
                answer = json.loads(response.read())
            assert answer["predictions"] == champion["expected"], sorted(data)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


PARAMS = {"max_new_tokens": 6, "batch_size": 4}


def test_the_registered_model_takes_the_shapes_its_signature_passes(champion, tmp_path, monkeypatch):
    """`{"prompt": [...]}` (one row whose cell is the list, after MLflow's enforcement), `{"prompt": "..."}`,
    records, a DataFrame and chat messages all generate what the evaluation generated."""

    monkeypatch.setenv("GRPO_MODEL_CACHE", str(tmp_path / "cache"))
    mlflow.set_tracking_uri(champion["uri"])
    model = mlflow.pyfunc.load_model(f"models:/serving-adapter@{CHAMPION}")
    texts = [serving.prompt_text(r["prompt"]) for r in ROWS]
    expected = champion["expected"]
    assert model.predict({"prompt": texts}, params=PARAMS) == expected
    assert model.predict([{"prompt": t} for t in texts], params=PARAMS) == expected
    assert model.predict({"prompt": texts[0]}, params=PARAMS) == expected[:1]
    assert model.predict([{"prompt": r["prompt"]} for r in ROWS], params=PARAMS) == expected  # chat messages
    with pytest.raises(Exception, match="prompt"):
        model.predict([{"question": texts[0]}], params=PARAMS)


def test_under_the_transformers_flavor_signature_strings_are_taken_too(tiny_model, adapter, tmp_path):
    """MLflow enforces the signature before the model sees its input: with an unnamed string column, as the
    transformers flavor logs text generation, a string and a list of strings reach the model and generate as
    the DataFrame does (under the named `prompt` column they are refused before the model runs). The DataFrame's
    outputs equal the evaluation's in the tests above; this one needs no server."""
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    cfg = load_config(None, ["evaluate.max_new_tokens=6", "evaluate.batch_size=4"])
    signature = ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", 6), ParamSpec("batch_size", "long", 4)]),
    )
    path = tmp_path / "model"
    mlflow.pyfunc.save_model(
        str(path),
        python_model=str(serving.MODEL_CODE),
        artifacts={"adapter": str(adapter)},
        model_config=serving.model_config(serving.BaseRef(reference=str(tiny_model)), cfg.model, cfg.evaluate),
        signature=signature,
        pip_requirements=["mlflow"],
    )  # listed: not inferred by loading
    model = mlflow.pyfunc.load_model(str(path))
    texts = [serving.prompt_text(r["prompt"]) for r in ROWS]
    expected = model.predict(pd.DataFrame({"prompt": texts}), params=PARAMS)
    assert len(expected) == len(ROWS) and all(isinstance(e, str) for e in expected)
    assert model.predict(texts, params=PARAMS) == expected
    assert model.predict(texts[0], params=PARAMS) == expected[:1]
    assert model.predict({"prompt": texts}, params=PARAMS) == expected
    assert model.predict([{"prompt": t} for t in texts], params=PARAMS) == expected
