"""The Python that runs vLLM for the tests of `grpo-pipeline serve`: `.venv-serve` (built by `make serve-env`) or
`$GRPO_SERVE_ENGINE_PYTHON`; a module of such tests calls `skip_without_engine()` first."""

import os
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_PYTHON = Path(os.environ.get("GRPO_SERVE_ENGINE_PYTHON", REPO / ".venv-serve" / "bin" / "python"))


def skip_without_engine() -> None:
    if not ENGINE_PYTHON.is_file():
        pytest.skip(
            f"no vLLM engine Python at {ENGINE_PYTHON}: run `make serve-env` (vLLM's CPU build in "
            ".venv-serve) or set GRPO_SERVE_ENGINE_PYTHON",
            allow_module_level=True,
        )


def engine_gone(url: str, within_s: float) -> bool:
    """Whether the engine at `url` stops answering within `within_s` seconds (it follows its router: the router's
    own stop, or PR_SET_PDEATHSIG when the router is killed)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/v1/models", timeout=2)
        except httpx.HTTPError:
            return True
        time.sleep(1)
    return False


# A stand-in for vLLM's server (tests/stand_in_vllm): on the engine's PYTHONPATH, the router's own `Engine` starts it
# with vLLM's command line. What the supervision, replica and soak checks run where vLLM's CPU build is not built.
STAND_IN_VLLM = REPO / "tests" / "stand_in_vllm"
