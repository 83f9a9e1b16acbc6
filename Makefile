# Two commands for a fresh machine: `make demo` (set up, then run the CPU demo) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# SkyPilot's own environment (its click<8.2 pin conflicts with the training stack): the launcher runs it there.
SKY_VENV ?= .venv-sky
SKY_PY := $(SKY_VENV)/bin/python
SKY_STAMP := $(SKY_VENV)/.installed

.PHONY: install demo test test-slow lint e2e bench check-deps clean

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

test-slow: $(STAMP)  # the checks that leave the default run for its 15-minute budget (markers: slow)
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)  # ruff's findings (pyproject.toml [tool.ruff]): zero, or the test run stops before pytest
	$(PY) -m ruff check .

e2e: $(STAMP)
	$(PY) -m pytest -m e2e

bench: $(STAMP)  # every benchmark (~1 hour on 2 cores), then the README's results table
	$(PY) -m bench all

clean:
	rm -rf $(VENV) $(SKY_VENV) .grpo
