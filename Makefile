# The two set-up commands of the README: `make demo` and `make test`.
# Each creates .venv from requirements.txt when it is missing (or older than requirements.txt);
# `make test` adds requirements-test.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.requirements-installed
TEST_INSTALLED := $(VENV)/.test-requirements-installed

# `make test` skips the slow end-to-end tests (minutes each); CI (CI=true) and `make test-all` run them.
ifeq ($(CI),true)
PYTEST_SELECT :=
else
PYTEST_SELECT := -m "not slow"
endif
# The tests run in TEST_PROCESSES processes (pytest-xdist; which tests share one: tests/conftest.py). A test's
# own processes keep about one of CI's two cores busy on average: two at once use both. 0: all in this
# process (for a debugger).
TEST_PROCESSES ?= 2
PYTEST_PROCESSES := $(if $(filter 0,$(TEST_PROCESSES)),,-n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder)

# `make figures`: figures/ and RESULTS.md from the run directories in RUNS (default: the runs
# committed in results/runs; e.g. `make figures RUNS=runs` for your own) and the upstream logs.
RUNS ?= results/runs
UPSTREAM ?= results/upstream
NOTES ?= $(if $(filter results/runs,$(RUNS)),--notes results/NOTES.md)
# Runs of the named recipes on the demo's digits (docs/recipes.md): RESULTS.md's recipes section only.
RECIPE_RUNS ?= $(wildcard results/recipe-runs)
# Benchmark CSVs (python -m common.tools.bench) whose tables RESULTS.md shows.
BENCH ?= $(wildcard results/bench/*.csv)
# The scaling model's predictions and validations (python -m common.tools.scaling, common.tools.link_validation).
SCALING ?= $(wildcard results/scaling/*.csv)
# The scaling model's prediction of the upstream's runs, drawn beside their measured scaling (RESULTS.md's summary).
SCALING_MODEL ?= $(wildcard results/scaling/upstream-v100-hal.csv)
# GPU sessions' --profile-steps summaries (an env.txt beside each names the GPU and the date).
PROFILES ?= $(wildcard results/gpu-*/profile-*-summary.txt)

.PHONY: demo test test-all bench gpu-check figures venv clean

venv: $(INSTALLED)

$(INSTALLED): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	@touch $@

# The tests' tools (pytest, hypothesis), on top of what training needs.
$(TEST_INSTALLED): $(INSTALLED) requirements-test.txt
	$(PY) -m pip install --disable-pip-version-check -q -r requirements-test.txt
	@touch $@

demo: $(INSTALLED)
	PYTHON=$(PY) bash run_scripts/demo.sh

test: $(TEST_INSTALLED)
	$(PY) -m pytest tests $(PYTEST_PROCESSES) $(PYTEST_SELECT)

test-all: $(TEST_INSTALLED)
	$(PY) -m pytest tests $(PYTEST_PROCESSES)

# `make bench`: the speed harness (README, "Speed"): ratios against the plain reference, a CSV in runs/bench/.
bench: $(INSTALLED)
	$(PY) -m common.tools.bench

# `make gpu-check`: on a machine with a CUDA GPU, the GPU record in one call
# (docs/tests.md#the-gpu-record-in-one-call): the parts in GPU_CHECK_PARTS (default: tests profile graphs
# bench decode matrix, most valuable first) within GPU_CHECK_SECONDS (default 540). It builds no venv: .venv's
# python where there is one, else python3 (a GPU image's, offline).
GPU_CHECK_PARTS ?=
gpu-check:
	bash run_scripts/gpu_check.sh $(GPU_CHECK_PARTS)

figures: $(INSTALLED)
	$(PY) -m common.tools.plots $(RUNS) --out figures
	$(PY) -m common.tools.plots $(UPSTREAM) --out figures/upstream $(if $(SCALING_MODEL),--scaling-model $(SCALING_MODEL))
	$(PY) -m common.tools.results $(RUNS) --upstream $(UPSTREAM) --figures figures $(NOTES) --recipes common/recipes $(if $(RECIPE_RUNS),--recipe-runs $(RECIPE_RUNS)) $(if $(BENCH),--bench $(BENCH)) $(if $(SCALING),--scaling $(SCALING)) $(if $(PROFILES),--profiles $(PROFILES)) > RESULTS.md.tmp
	mv RESULTS.md.tmp RESULTS.md

clean:
	rm -rf runs data/digits .bench-data .pytest_cache tests/.pytest_cache .hypothesis tests/.hypothesis
