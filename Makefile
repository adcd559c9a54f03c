# Two entry points that work on a fresh machine with Python 3.11 and the package registry:
#   make demo   - set up .venv and run the end-to-end demo release
#   make test   - set up .venv, lint (ruff + mypy), then run the whole test suite
#   make lint   - ruff and mypy only (configured in pyproject.toml); fails on any finding
#   make fuzz   - the property tests with random seeds and FUZZ_EXAMPLES times their example budget
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := deploy/constraints-py3.11.txt

export GX_ANALYTICS_ENABLED := false
export SCARF_ANALYTICS := false
export DO_NOT_TRACK := true

.PHONY: demo test lint venv bench clean fuzz compile

$(STAMP): pyproject.toml $(CONSTRAINTS)
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[all]'
	touch $(STAMP)

venv: $(STAMP)

# Lint first so a style or type slip fails in seconds, not after the suite. The rule sets
# live in pyproject.toml ([tool.ruff], [tool.mypy]); tests get a lighter ruff set there.
LINT_PATHS := dpops pipelines dags plugins

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS) tests
	$(PY) -m mypy $(LINT_PATHS)

# Three pytest processes on the two cores, a whole test file per process (module fixtures such as the
# moto server and the Airflow stacks stay in one process). About half the suite's time is spent waiting
# on real Airflow/Beam processes (scheduler loops, sensor pokes, job services), so a third process fills
# the cores those waits leave idle: on this 2-core machine, under load from other jobs, 3 processes ran
# the suite in 14.5 min where 2 took 16.9. --no-loadscope-reorder keeps the collection order, in which
# tests/conftest.py puts the slowest files first (SLOWEST_FIRST), so the last files handed out are short
# and the processes finish together. --durations lists the 25 slowest steps, so a slow run says where it went.
# Bytecode of the project's own packages, written once: with PYTHONDONTWRITEBYTECODE set (as on the CI machine's
# shell) no import writes it, so every CLI child, Airflow task and Beam worker the suite starts compiled dpops anew
# (~0.3 CPU-s each). Python still reads bytecode that is there and recompiles any file changed since.
compile: $(STAMP)
	$(PY) -m compileall -q -j 2 dpops pipelines dags plugins demo

test: lint compile
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder --durations=25 $(PYTEST_ARGS)

# make test runs every Hypothesis property with a fixed seed (the "ci" profile of tests/fuzz_support.py), so a
# change lands or fails on its own code. make fuzz explores: the "fuzz" profile (random seeds, print_blob),
# each property's budget times FUZZ_EXAMPLES (default 20), only the Hypothesis tests (-m hypothesis) of the
# files that use it. A failure prints its falsifying example: add it as an @example on the property.
FUZZ_EXAMPLES ?= 20
FUZZ_FILES ?= $(shell grep -l '^from hypothesis' tests/test_*.py)
FUZZ_JOBS ?= 3

fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -n $(FUZZ_JOBS) --dist loadfile \
		-m hypothesis $(FUZZ_FILES) $(PYTEST_ARGS)

demo: $(STAMP) compile
	$(PY) demo/run_demo.py $(DEMO_ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench_samplers.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info demo-output
