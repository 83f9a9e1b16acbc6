"""The MLflow model of a GRPO adapter (or of a merged model): MLflow's models-from-code file, copied into each
logged model and run from there. It imports only mlflow, transformers, peft and torch, never this project, so
`mlflow.pyfunc.load_model("models:/grpo-adapter@champion")` and `mlflow models serve` work anywhere MLflow,
transformers and peft are installed.

Input, in the shapes MLflow's transformers flavor takes: a string, a list of strings, `{"prompt": [...]}` or
`{"prompt": "..."}`, records (`[{"prompt": "..."}]`) and a DataFrame whose `prompt` column (or, under an unnamed
signature, whose first column) holds them. A prompt is plain text (one user message), a list of chat messages
(`[{"role": "user", "content": "..."}]`), or that list as JSON text. Output: one completion per prompt, in
order (a cell holding a list of strings is several prompts), greedy, decoded as the pipeline's evaluation
decodes it (the model's chat template, through the evaluation's own renderer `chat_prompts.render`, left
padding, special tokens skipped). Params: `max_new_tokens`,
`batch_size`. MLflow enforces the logged signature before `predict` sees the input: a plain string or list of
strings reaches it only under an unnamed string column (`ColSpec("string")`, as the transformers flavor logs).

The model config names the base: a hub id, or the URI of the base's copy in the artifact store (downloaded
once per content hash into `$GRPO_MODEL_CACHE`, default `~/.cache/grpo-models`).
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import mlflow
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

try:  # in a logged model, shipped beside this file (code_paths): the renderer the pipeline's evaluation uses
    from chat_prompts import render  # type: ignore[import-not-found]  # only there, beside this file
except ModuleNotFoundError:  # read inside the project (its doctests): the same file under its package name
    from grpo_pipeline.tasks.chat_prompts import render


def _is_uri(reference: str) -> bool:
    return "://" in reference or reference.startswith(("runs:/", "models:/", "mlflow-artifacts:"))


def local_base(reference: str, digest: str | None, tracking_uri: str | None = None) -> str:
    """A directory or hub id `from_pretrained` (or an engine) loads: a URI is downloaded once per content hash
    into `$GRPO_MODEL_CACHE`. `tracking_uri`: the MLflow server a `runs:/` or `models:/` URI is read from (None:
    MLflow's current one, as when this model is loaded). The one copy of this logic: the router
    (`grpo_pipeline.tasks.serve.adapters`) calls it too, so both share the cache."""
    if not _is_uri(reference):
        return reference
    cache = Path(os.environ.get("GRPO_MODEL_CACHE", Path.home() / ".cache" / "grpo-models"))
    if digest and (cache / digest / "config.json").is_file():
        return str(cache / digest)
    cache.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(dir=cache, prefix=".download-")
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=reference, dst_path=staging, tracking_uri=tracking_uri)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # no half-downloaded copy left in the cache
        raise
    if not digest:
        return local
    target = cache / digest
    try:
        Path(local).rename(target)  # whole or not at all; a concurrent download may have won
    except OSError:
        pass
    if (target / "config.json").is_file():
        shutil.rmtree(staging, ignore_errors=True)  # empty now, or the copy a concurrent download beat
        return str(target)
    return local


def _is_chat(value: object) -> bool:
    return isinstance(value, dict) and "role" in value


def _expand(cell: object) -> list:
    """The prompts one input cell holds. MLflow's enforcement turns `{"prompt": ["a", "b"]}` into one row whose
    cell is the list, and the scoring server turns JSON lists into numpy arrays: a list of strings (or of
    chats) is several prompts, a list of message dicts is one chat."""
    if hasattr(cell, "tolist"):  # numpy array or scalar from the scoring server
        cell = cell.tolist()
    if isinstance(cell, (list, tuple)):
        cell = list(cell)
        if cell and all(_is_chat(m) for m in cell):
            return [cell]
        out = []
        for item in cell:
            out += _expand(item)
        return out
    if isinstance(cell, dict) and not _is_chat(cell):
        if "prompt" not in cell:
            raise ValueError(
                f"an input record has no 'prompt' (keys: {sorted(cell)}); pass "
                '{"prompt": "<text or chat messages>"}'
            )
        return _expand(cell["prompt"])
    if cell is None:
        raise ValueError("an input prompt is empty (None); pass text or a list of chat messages")
    return [cell]


def _prompts(model_input: Any) -> list:  # a DataFrame, dict, list or text: whatever pyfunc was given
    """Every prompt in the input, in order, whatever shape of those the module docstring lists it came in.

    >>> _prompts("Hi")
    ['Hi']
    >>> _prompts({"prompt": ["a", "b"]})
    ['a', 'b']
    >>> _prompts([{"prompt": "a"}, {"prompt": [{"role": "user", "content": "b"}]}])
    ['a', [{'role': 'user', 'content': 'b'}]]
    """
    if hasattr(model_input, "columns"):  # a DataFrame, as pyfunc and the scoring server pass it
        column = "prompt" if "prompt" in model_input.columns else model_input.columns[0]
        cells = list(model_input[column])
    elif isinstance(model_input, (dict, str)) or not hasattr(model_input, "__iter__"):
        cells = [model_input]
    else:
        cells = list(model_input)
    out = []
    for cell in cells:
        out += _expand(cell)
    return out


class GRPOChatModel(PythonModel):
    def load_context(self, context):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cfg = context.model_config or {}
        self.max_new_tokens = int(cfg.get("max_new_tokens", 64))
        self.batch_size = int(cfg.get("batch_size", 8))
        trust = bool(cfg.get("trust_remote_code", False))
        merged = context.artifacts.get("merged")
        weights = merged or local_base(cfg["base"], cfg.get("base_sha256"))
        tokenizer_dir = merged or context.artifacts["adapter"]
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, trust_remote_code=trust)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "left"  # decoder-only models continue from the right edge
        quantization = cfg.get("quantization", "none")
        dtype = getattr(torch, cfg.get("compute_dtype", "float32"))
        kwargs = {"dtype": dtype, "trust_remote_code": trust}
        if quantization != "none" and not merged:  # the adapter was trained and evaluated on this base
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = (
                BitsAndBytesConfig(load_in_8bit=True)
                if quantization == "int8"
                else BitsAndBytesConfig(
                    load_in_4bit=True,
                    bnb_4bit_quant_type=quantization,
                    bnb_4bit_use_double_quant=bool(cfg.get("double_quant", False)),
                    bnb_4bit_compute_dtype=dtype,
                )
            )
        model = AutoModelForCausalLM.from_pretrained(weights, **kwargs)
        if not merged:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, context.artifacts["adapter"])
        self.model = model.eval()

    def predict(self, context, model_input, params=None):
        import torch

        params = params or {}
        max_new_tokens = int(params.get("max_new_tokens") or self.max_new_tokens)
        batch_size = int(params.get("batch_size") or self.batch_size)
        texts = render(self.tokenizer, _prompts(model_input))  # as the pipeline's evaluation renders them
        out = []
        with torch.inference_mode():
            for start in range(0, len(texts), batch_size):
                batch = self.tokenizer(
                    texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
                ).to(self.model.device)
                generated = self.model.generate(
                    **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
                )
                out += self.tokenizer.batch_decode(
                    generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
                )
        return out


set_model(GRPOChatModel())
