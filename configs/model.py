"""`model.*`: the base model (a hub id, a local directory, a GGUF file or the demo model), its quantization, the
candidates the base is chosen among, the bound on what quantization may cost, and the adapter training starts from."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from grpo_pipeline.configs.base import StrictModel
from grpo_pipeline.configs.dtypes import DType, Quantization

DEMO_MODEL = "smollm2-135m-instruct"
# model.init_adapter: continue the champion when the registry has one, else train a fresh adapter (a cold run). What
# a daily schedule wants: its first day has no champion yet, and 'champion' refuses that (exit 2) on purpose.
CHAMPION_OR_BASE = "champion_or_base"


class QuantizationBound(StrictModel):
    """How much quality a quantized base may lose against the unquantized one, measured on val rows."""

    max_reward_drop: float = Field(0.05, ge=0, description="mean weighted total reward, unquantized minus quantized")
    max_perplexity_ratio: float = Field(
        1.10, ge=1, description="perplexity of the reference answers, quantized / unquantized"
    )
    rows: int = Field(32, ge=1, description="val rows measured; more = surer, slower")


class ModelConfig(StrictModel):
    base: str = Field(
        DEMO_MODEL,
        description=f"'{DEMO_MODEL}' (the demo model), a local model directory, a .gguf file, or a hub id",
    )
    quantization: Quantization = Field("none", description="bitsandbytes quantization of the frozen base (nf4 = QLoRA)")
    double_quant: bool = Field(False, description="nested 4-bit quantization: ~0.4 bit/param less memory")
    compute_dtype: DType = "float32"
    trust_remote_code: bool = Field(
        False,
        description="run Python code shipped inside a model repository (a few architectures need it); "
        "off: only code from the installed transformers runs",
    )
    candidates: list[str] = Field(
        default_factory=list,
        description="bases to choose from (same forms as base), each scored zero-shot on val and priced; empty: just base",
    )
    max_quantization_cost: QuantizationBound | None = Field(
        None,
        description="refuse a quantization mode whose measured cost (quantized vs unquantized on val) passes these; None: measure and log only",
    )
    init_adapter: str = Field(
        "none",
        description="the LoRA adapter training starts from: 'none' (a fresh adapter on the base), 'champion' "
        "(the registry's champion; refused while there is none), 'champion_or_base' (the champion once there is one, "
        "a fresh adapter on the base until then: a daily schedule's first day), or a URI: models:/<name>/<version>, models:/<name>@<alias>, runs:/<run_id>/<path>; "
        "same base and LoRA shape (train.lora r, target_modules), optimizer and step count fresh",
    )

    @field_validator("init_adapter")
    @classmethod
    def _init_adapter(cls, v: str) -> str:
        v = v.strip()
        if v in ("none", "champion", CHAMPION_OR_BASE) or init_adapter_uri_problem(v) is None:
            return v
        raise ValueError(init_adapter_uri_problem(v))


def init_adapter_uri_problem(uri: str) -> str | None:
    """What is wrong with `model.init_adapter` as a URI, or None when it has a form the registry resolves.

    >>> init_adapter_uri_problem("models:/grpo-adapter/3") is None, init_adapter_uri_problem("runs:/abc/adapter") is None
    (True, True)
    >>> init_adapter_uri_problem("/tmp/adapter")
    "'/tmp/adapter' is not 'none', 'champion', 'champion_or_base', models:/<name>/<version>, models:/<name>@<alias> or runs:/<run_id>/<path>"
    """
    if re.fullmatch(r"models:/[^/@]+(/\d+|@[\w-]+)", uri) or re.fullmatch(r"runs:/[0-9a-zA-Z]+/\S+", uri):
        return None
    return (
        f"{uri!r} is not 'none', 'champion', 'champion_or_base', models:/<name>/<version>, models:/<name>@<alias> or "
        "runs:/<run_id>/<path>"
    )
