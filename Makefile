# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install, run the tour and solver notebooks headless plus a short CPU
#               training run, and write the explained report runs/<id>/report.html
#   make test   create .venv, install, run the tests in parallel (one pytest worker per core; the
#               multi-process, notebook and browser tests in lanes: see tests/_xdist_heavy.py)
#               (make test-fast: only the tests that start no torchrun, kernel or browser and take
#               under about 2 s each)
# And, once installed:
#   make lab    JupyterLab on the notebooks (token on, bound to 127.0.0.1; LAB_PORT=8888)
# On a GPU machine, without any set-up (the machine's own python3 and its CUDA torch; no .venv):
#   make gpu-check   at most 8 minutes on one H100/H200 (4 on an H200): gpu-check/result.json + report.md (docs/gpu-check.md)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url <your CPU wheel index>".
# FLASH_ATTN_BUILD=1 builds flash-attn from source where no prebuilt wheel matches (long; needs nvcc).
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers: "auto" is one per physical core; TEST_WORKERS=0 runs the tests in this process
TEST_WORKERS ?= auto
LAB_PORT ?= 8888

# make gpu-check GPU_CHECK_ARGS="--parts attention --budget-s 120": rerun pieces (docs/gpu-check.md)
GPU_CHECK_ARGS ?=

.PHONY: demo test test-fast install bench lint clean lab gpu-check

$(STAMP): pyproject.toml Makefile workbench/installer.py
	$(PY) -m venv $(VENV)
	@# torch first, pinned: where no CUDA is present the CPU build (found offline through pip's
	@# find-links here); where nvidia-smi lists a GPU the index's CUDA build (checked after install)
	$(BIN)/python workbench/installer.py torch $(TORCH_PIP_ARGS)
	$(BIN)/pip install -e '.[dev]'
	@# jsonschema's optional IRI format checker (rfc3987-syntax, pulled in by jupyter-events' jsonschema[format-nongpl])
	@# builds an Earley grammar whenever jsonschema is imported: 1.3 s of CPU in every kernel, papermill run and
	@# Jupyter server; nothing here checks IRIs (jsonschema skips the two formats without it; docs/benchmarks.md)
	-$(BIN)/pip uninstall -y -q rfc3987-syntax
	@# flash-attn on CUDA machines only: its prebuilt wheel for this torch/CUDA/Python when the release
	@# has one, else one line saying the PyTorch attention path is used (FLASH_ATTN_BUILD=1: build it)
	-$(BIN)/python workbench/installer.py flash-attn
	touch $(STAMP)

install: $(STAMP)

# the doctor's summary first: what this machine can do (a failing line does not stop the demo)
demo: $(STAMP)
	-$(BIN)/workbench doctor
	$(BIN)/workbench demo

# the run store is the project's runs/ whatever folder the notebooks run in; the token stays on
lab: $(STAMP)
	WORKBENCH_RUNS=$(CURDIR)/runs $(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 \
	  --ServerApp.port=$(LAB_PORT) --no-browser $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# tests/_xdist_heavy.py runs the heavy (slow) tests at most two at once: the timed ones one at a time from
# the start on one worker, each module's untimed ones on whichever worker is free, the fast tests filling
# the end. The ten slowest are listed at the end.
# The tests start about 400 Python processes (ranks, supervisors, kernels, commands): each compiles the
# project's modules afresh where the environment says not to write bytecode (some container images set
# PYTHONDONTWRITEBYTECODE), so the tests let Python cache it under the git-ignored __pycache__/ folders
# (392 -> 356 s of make test on 2 cores; docs/benchmarks.md).
TEST_ENV := PYTHONDONTWRITEBYTECODE=
test: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=10 $(PYTEST_ARGS)

# the edit-test loop: the tests that start no torchrun, kernel or browser, need no quiet cores and take
# under about 2 s each (not slow, not serial, not long); make test stays the whole suite
test-fast: $(STAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow and not serial and not long" --durations=5 $(PYTEST_ARGS)

# no $(STAMP): the check runs with $(PY) as it is (numpy and a CUDA torch), from this folder
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m workbench.gpucheck $(GPU_CHECK_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/planners.py

lint: $(STAMP)
	$(BIN)/ruff check workbench widgets tests bench

clean:
	rm -rf $(VENV) build *.egg-info
