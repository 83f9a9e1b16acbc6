"""`ab.*`: the live A/B between the registry's `champion` and `challenger` (pure pydantic, no I/O).

What the online decision (`grpo_pipeline.tasks.serve.ab.decide`) reads: the traffic share of the challenger, the error level of
the always-valid sequential test, the guardrails that roll a challenger back whatever its scores, and the
minimum sample and maximum duration. Set any of them with `--set ab.<field>=<value>`.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from grpo_pipeline.configs.base import StrictModel


class Guardrails(StrictModel):
    """Bounds on the challenger relative to the champion, checked before any score is compared; a breach rolls
    the challenger back at the next decision. Checked once both arms have `min_requests` requests."""

    min_requests: int = Field(100, ge=1, description="requests per arm before a guardrail can fire")
    latency_p95_ratio_max: float = Field(
        1.5, ge=1.0, description="challenger p95 latency / champion p95 latency above this: rollback"
    )
    latency_p95_max_s: float | None = Field(
        None, gt=0, description="absolute p95 latency bound on the challenger, seconds (None: no bound)"
    )
    error_rate_margin: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="challenger error rate minus champion error rate above this: rollback (0.02 = 2 points)",
    )
    completion_tokens_ratio_min: float = Field(
        0.5, gt=0.0, description="challenger mean completion tokens / champion's below this: rollback (collapse)"
    )
    completion_tokens_ratio_max: float = Field(
        2.0, gt=0.0, description="... above this: rollback (rambling costs latency and money)"
    )

    @model_validator(mode="after")
    def _ratio_bounds_ordered(self) -> Guardrails:
        if self.completion_tokens_ratio_min > self.completion_tokens_ratio_max:
            raise ValueError(
                f"ab.guardrails.completion_tokens_ratio_min ({self.completion_tokens_ratio_min}) is above "
                f"completion_tokens_ratio_max ({self.completion_tokens_ratio_max}); set min <= max"
            )
        return self


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank takes


class ServeConfig(StrictModel):
    """`grpo-pipeline serve`: the router in front of one vLLM engine holding the base and the aliases' adapters.

    The engine runs from its own Python (`make serve-env` builds `.venv-serve` with vLLM's CPU build; on a GPU
    machine, a venv with `vllm`), bound to 127.0.0.1 on a port only the router uses."""

    poll_s: float = Field(30.0, gt=0, description="seconds between reads of the registry's aliases (hot-swap)")
    engine_python: str | None = Field(
        None, description="the Python that runs vLLM (None: .venv-serve/bin/python in the working directory)"
    )
    engine_port: int | None = Field(
        None, ge=1024, le=65535, description="loopback port of the engine (None: a free one, chosen at start)"
    )
    max_lora_rank: int = Field(16, description="vLLM --max-lora-rank: every adapter's rank must be at or below it")
    max_model_len: int = Field(1024, ge=16, description="vLLM --max-model-len: prompt plus completion tokens")
    dtype: str = Field("bfloat16", pattern="^(auto|bfloat16|float16|float32)$", description="vLLM --dtype")
    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="vLLM --gpu-memory-utilization; on the CPU build, the share of the machine's memory it may "
        "take (it refuses to start when less is free); raise it on a GPU of its own",
    )
    startup_timeout_s: float = Field(900.0, gt=0, description="seconds the engine may take to answer /v1/models")
    request_timeout_s: float = Field(300.0, gt=0, description="seconds a request may wait on the engine")
    probe_s: float = Field(5.0, gt=0, description="seconds between the router's checks that its engine lives")
    probe_timeout_s: float = Field(
        30.0, gt=0, description="seconds the engine may take to answer a check (/v1/models) before it counts as hung"
    )
    restart_limit: int = Field(
        5, ge=1, description="engine starts in a row that may fail before the router gives up and exits (status 1)"
    )
    retry_after_s: int = Field(5, ge=1, description="Retry-After of the 503 a request gets while the engine restarts")
    reattach_engine: bool = Field(
        False,
        description="a killed router leaves its engine running and the next router on the same data_dir attaches "
        "to it (for a supervisor that restarts the router, as the stack's does: seconds, not an engine start); "
        "off: the engine dies with its router",
    )
    log_completions: bool = Field(
        True,
        description="keep each answer's text in the request log, so feedback with a `reference` can be scored by "
        "the pipeline's rewards; off: only counts and timings are logged (and `reference` feedback is refused)",
    )

    @model_validator(mode="after")
    def _rank_is_one_vllm_takes(self) -> ServeConfig:
        if self.max_lora_rank not in LORA_RANKS:
            raise ValueError(
                f"ab.serve.max_lora_rank={self.max_lora_rank} is not one vLLM takes; use one of "
                f"{', '.join(map(str, LORA_RANKS))} at or above the adapters' rank"
            )
        return self


class ABConfig(StrictModel):
    """The live test. Outcomes are the feedback scores (`POST /v1/feedback`), compared as means per arm."""

    challenger_fraction: float = Field(
        0.1, ge=0.0, le=1.0, description="share of users (by hash of their key) sent to the challenger, 0..1"
    )
    alpha: float = Field(
        0.05,
        gt=0.0,
        lt=1.0,
        description="error level of the sequential test: the chance of declaring a difference between equal "
        "arms, however often the decision runs",
    )
    mixture_effect: float = Field(
        0.2,
        gt=0.0,
        description="standardized effect (difference in outcome standard deviations) the test finds fastest; "
        "any real effect is found eventually, this only tunes where the test is most sensitive",
    )
    min_samples: int = Field(100, ge=2, description="scored responses per arm before the test may decide")
    max_duration_h: float = Field(
        168.0, gt=0.0, description="hours after which an undecided test stops: no difference, champion stays"
    )
    guardrails: Guardrails = Guardrails()
    serve: ServeConfig = ServeConfig()
