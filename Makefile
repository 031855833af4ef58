# Set-up and the main jobs on a fresh machine. Everything installs into $(VENV).
VENV ?= .venv
PYTHON ?= python3
# The CPU build of torch; on a GPU machine use e.g. TORCH_SPEC='torch' (a CUDA build).
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tritonopt-installed

.PHONY: install test test-all demo experiments bench autotune clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,perf,demo]"
	touch $(STAMP)

test: install
	$(PY) -m pytest -q

test-all: install
	$(PY) -m pytest -q -m "not gpu"

demo: install
	$(PY) perf/demo_digits.py

# The papers' claims at CPU scale; each writes its table and plot under perf/results/.
experiments: install
	$(PY) perf/efcp_experiment.py
	$(PY) perf/kfac_experiment.py
	$(PY) perf/kaisa_tradeoff.py
	$(PY) perf/fosi_experiment.py
	$(PY) perf/dsp_experiment.py

# Kernel benchmarks; on a machine without CUDA they time the torch reference only.
bench: install
	$(PY) perf/bench_ef_topk.py
	$(PY) perf/bench_sparse_ring.py
	$(PY) perf/bench_lowrank.py
	$(PY) perf/bench_kfac.py
	$(PY) perf/bench_lanczos.py

# Warm Triton's autotune cache for real model shapes (GPU) and record the chosen configs.
autotune: install
	$(PY) perf/autotune.py --model resnet18 bert-base

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
