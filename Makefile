# Two commands for a fresh machine: `make demo` (set up, then run the CPU demo) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint e2e bench check-deps clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip check
	touch $(STAMP)

install: $(STAMP)

check-deps: $(STAMP)
	$(PY) -m pip check

demo: $(STAMP)
	$(VENV)/bin/grpo-pipeline run

# Two workers, one per core of the CI machine; a test file stays on one worker (its module fixtures are built once).
TEST_WORKERS ?= 2

test: lint
	$(PY) -m pytest -m "not e2e and not slow" -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)  # the checks that leave the default run for its 15-minute budget (markers: slow)
	$(PY) -m pytest -m slow -n $(TEST_WORKERS) --dist loadfile

# ruff's findings, then mypy's over the package (pyproject.toml [tool.ruff], [tool.mypy]): zero, or the test run
# stops before pytest. mypy caches in .mypy_cache: a first run takes minutes, a later one seconds.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m tests.typecheck

e2e: $(STAMP)
	$(PY) -m pytest -m e2e

bench: $(STAMP)  # every benchmark (~1 hour on 2 cores), then the README's results table
	$(PY) -m bench all

clean:
	rm -rf $(VENV) .grpo
