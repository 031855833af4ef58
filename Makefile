# Set-up and the main jobs on a fresh machine. Everything installs into $(VENV).
VENV ?= .venv
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
# Where torch comes from: empty for pip's configured indexes (PyPI's Linux x86_64 wheel is the CUDA
# build), or one of PyTorch's own, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu.
TORCH_INDEX ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tritonopt-installed
# pip shows what it downloads and installs; PIP_FLAGS=--quiet silences it.
PIP_FLAGS ?=

.PHONY: docs install test test-smoke test-multirank test-all compile-check demo demo-reference experiments bench autotune anchors bench-anchors clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@echo "==> creating the virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip"
	$(PY) -m pip install $(PIP_FLAGS) --upgrade pip
	@echo "==> installing $(TORCH_SPEC)$(if $(TORCH_INDEX), from $(TORCH_INDEX)) (the largest download, the first time)"
	$(PY) -m pip install $(PIP_FLAGS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	@echo "==> installing tritonopt (editable) with its test, perf, demo and docs extras"
	$(PY) -m pip install $(PIP_FLAGS) -e ".[test,perf,demo,docs]"
	touch $(STAMP)
	@echo "==> installed into $(VENV)"

test: install
	$(PY) -m pytest -q

# Every script run end to end as a subprocess: the perf scripts in smoke mode (the experiments, the
# demo, the benchmarks), the docs' whole scripts under torchrun, gpu_run.sh (a few CPU minutes);
# CI runs them after the default suite.
test-smoke: install
	$(PY) -m pytest -q -m "smoke and not slow and not gpu"

# The tests that spawn 4 gloo ranks (1-D meshes of 4 and 2x2 HSDP meshes; minutes on 2 cores);
# CI runs them after the default suite.
test-multirank: install
	$(PY) -m pytest -q -m multirank

test-all: install
	$(PY) -m pytest -q -m "not gpu"

# The documentation site (docs/ and the API reference from the docstrings) into build/site;
# fails on a page or reference that does not resolve.
docs: install
	$(PY) -m mkdocs build --strict

# Compile every kernel for sm_90 (H100) at every config of its autotune space and
# at ResNet-18 / BERT-base shapes, without a GPU; fails on a compile error, on
# register spills or on shared memory over the H100 limit. The table:
# $(PY) tests/test_sm90_compile.py --full
compile-check: install
	$(PY) -m pytest -q -p no:cacheprovider -m compile tests/test_sm90_compile.py

# The demo writes to perf/results/local/demo/ (not committed).
demo: install
	@echo "==> training 8 optimizers x 2 seeds on the digits MLP (about a minute on 2 CPU cores)"
	$(PY) -m perf.demo_digits

# Regenerates the committed figures the README quotes, perf/results/demo/.
demo-reference: install
	$(PY) -m perf.demo_digits --out perf/results/demo

# The papers' claims at CPU scale; each writes its table and plot under perf/results/ and
# exits 1 when a claim it checks fails. Every script runs even after one fails (a failed claim is
# a result too); the target then names the failed scripts and exits 1.
EXPERIMENTS = efcp_experiment kfac_experiment kaisa_tradeoff fosi_experiment ssd_sgd_experiment \
	dsp_experiment comm_hooks_experiment sharded_quality
experiments: install
	@failed=""; for script in $(EXPERIMENTS); do \
		echo "==> python -m perf.$$script"; \
		$(PY) -m perf.$$script || failed="$$failed $$script"; \
	done; \
	if [ -n "$$failed" ]; then echo "==> a claim failed in:$$failed"; exit 1; fi

# Kernel and optimizer-step benchmarks; on a machine without CUDA they time the reference
# path only, into perf/results/cpu/ (not committed).
bench: install
	$(PY) -m perf.bench_ef_topk
	$(PY) -m perf.bench_sparse_ring
	$(PY) -m perf.bench_lowrank
	$(PY) -m perf.bench_kfac
	$(PY) -m perf.bench_lanczos
	$(PY) -m perf.bench_sgd_momentum
	$(PY) -m perf.bench_ssd_sgd
	$(PY) -m perf.bench_optimizer_step
	$(PY) -m perf.bench_sharded
	$(PY) -m perf.bench_dsp_recompute

# The authors' implementations that perf.bench_anchors compares with (not dependencies of
# tritonopt): checkouts at the commits the README's figures were measured with, in
# $(ANCHORS_DIR), and torchopt, which hsivan/fosi's torch version needs. The checkouts are
# imported from where they are, not installed. ANCHORS_URL: where owner/name is cloned from.
ANCHORS_DIR ?= .anchors
ANCHORS_URL ?= https://github.com
ANCHOR_CHECKOUTS := \
	kfac-pytorch=gpauloski/kfac-pytorch@869cf110334e5a6e9ea054bafdc4558313a821e8 \
	fosi=hsivan/fosi@cf040ce1a3ddfdc8bf3071ef825874fb529ac4fa \
	EFCP=IST-DASLab/EFCP@a33a3a5725fbe78ab3ed7e8ce246a8c77b0dfb62

anchors: install
	@for spec in $(ANCHOR_CHECKOUTS); do \
		folder=$${spec%%=*}; rest=$${spec#*=}; repo=$${rest%@*}; commit=$${rest#*@}; \
		dir=$(ANCHORS_DIR)/$$folder; \
		test -d $$dir || git clone -q $(ANCHORS_URL)/$$repo $$dir || exit 1; \
		git -C $$dir cat-file -e $$commit^{commit} 2>/dev/null || git -C $$dir fetch -q origin || exit 1; \
		git -C $$dir checkout -q $$commit || exit 1; \
		echo "==> $$dir: $$repo at $$commit"; \
	done
	$(PY) -m pip install $(PIP_FLAGS) torchopt

bench-anchors: anchors
	$(PY) -m perf.bench_anchors --anchors $(ANCHORS_DIR)

# Warm Triton's autotune cache for real model shapes (GPU) and record the chosen configs.
autotune: install
	$(PY) -m perf.autotune --model resnet18 bert-base

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
