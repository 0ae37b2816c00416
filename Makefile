# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install, run the tour and solver notebooks headless plus a short CPU
#               training run, and write the explained report runs/<id>/report.html
#   make test   create .venv, install, run the tests in parallel (one pytest worker per core; the
#               multi-process, notebook and browser tests one at a time: see tests/conftest.py)
# And, once installed:
#   make lab    JupyterLab on the notebooks (token on, bound to 127.0.0.1; LAB_PORT=8888)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Extra pip arguments for torch, e.g. TORCH_PIP_ARGS="--index-url <your CPU wheel index>".
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers: "auto" is one per physical core; TEST_WORKERS=0 runs the tests in this process
TEST_WORKERS ?= auto
LAB_PORT ?= 8888

.PHONY: demo test install bench lint clean lab

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	@# torch first, pinned: where no CUDA is present the CPU build (found offline through pip's
	@# find-links here); where CUDA is present the default build plus the gpu extra (flash-attn).
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "CUDA found: installing torch==2.13.0 and the gpu extra"; \
	  $(BIN)/pip install $(TORCH_PIP_ARGS) torch==2.13.0 && \
	  $(BIN)/pip install -e '.[dev]' && \
	  ($(BIN)/pip install --no-build-isolation -e '.[gpu]' || echo "flash-attn did not install: the PyTorch attention path will be used"); \
	else \
	  echo "no CUDA: installing the CPU build of torch==2.13.0"; \
	  $(BIN)/pip install $(TORCH_PIP_ARGS) torch==2.13.0 && \
	  $(BIN)/pip install -e '.[dev]'; \
	fi
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/workbench demo

# the run store is the project's runs/ whatever folder the notebooks run in; the token stays on
lab: $(STAMP)
	WORKBENCH_RUNS=$(CURDIR)/runs $(BIN)/jupyter lab --notebook-dir=notebooks --ServerApp.ip=127.0.0.1 \
	  --ServerApp.port=$(LAB_PORT) --no-browser $$( [ "$$(id -u)" = 0 ] && echo --allow-root )

# tests/_xdist_heavy.py schedules the heavy (slow) tests on one worker, one at a time, from the start;
# the fast ones spread over the other workers. The ten slowest are listed at the end.
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=10 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/planners.py

lint: $(STAMP)
	$(BIN)/ruff check workbench widgets tests bench

clean:
	rm -rf $(VENV) build *.egg-info
