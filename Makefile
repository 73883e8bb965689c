# changebus: one entry point for set-up, tests, lint, benchmarks and the demo.
# `make test` works on a fresh machine: it installs system packages (as root,
# when missing), creates .venv and installs the project with its extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed
EXTRAS := dev,mysql,zk,spark
PYTEST_ARGS ?=
# test files run on this many workers (pytest-xdist; a file's tests stay on one worker, so
# module-scoped servers start once); 1 runs them in this process
TEST_WORKERS ?= 2

.PHONY: all install system-deps test lint fmt bench demo wheel clean

all: test

system-deps:
	@bash deploy/scripts/install-system-deps.sh

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[$(EXTRAS)]"
	@# the venv's own pyspark (not a $$SPARK_HOME elsewhere), when the spark extra is installed
	@if $(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('pyspark') is None)"; then \
	  $(PY) -m changebus.schemas spark precompile --pyspark-package; fi
	@touch $(STAMP)

install: system-deps $(STAMP)

# two phases: everything but the latency-bound tests (marker `timing`) on the workers,
# then those alone, so that no other test shares the cores with them; a phase that
# selects no test (exit 5) is fine unless both do
test: install
	@rc1=0; rc2=0; \
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) -m "not timing" $(PYTEST_ARGS) || rc1=$$?; \
	if [ $$rc1 -ne 0 ] && [ $$rc1 -ne 5 ]; then exit $$rc1; fi; \
	$(PY) -m pytest -m timing $(PYTEST_ARGS) || rc2=$$?; \
	if [ $$rc2 -ne 0 ] && [ $$rc2 -ne 5 ]; then exit $$rc2; fi; \
	if [ $$rc1 -eq 5 ] && [ $$rc2 -eq 5 ]; then echo "no tests were collected" >&2; exit 5; fi

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

fmt: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: install
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

demo: install
	$(PY) -m changebus.schemas demo $(DEMO_ARGS)

wheel: $(STAMP)
	$(PY) -m build --wheel --outdir dist .

clean:
	rm -rf $(VENV) dist build .mypy_cache .pytest_cache .ruff_cache .hypothesis
