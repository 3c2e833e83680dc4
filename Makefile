# The two commands a newcomer runs: `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.npuserve-installed
DEMO_DIR := .demo

.PHONY: setup test lint typecheck unit demo clean

setup: $(STAMP)

# Reinstall only when the dependency list changes; the editable install picks up code changes by itself.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -P -m venv $(VENV)
	$(BIN)/python -P -m pip install --quiet --upgrade pip
	$(BIN)/python -P -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

lint: setup
	$(BIN)/ruff check .

typecheck: setup
	$(BIN)/mypy npuserve engine/kvcache engine/scheduler operator

unit: setup
	$(BIN)/pytest -q

test: lint typecheck unit

demo: setup
	$(BIN)/npuserve model create-dummy --preset tiny --out $(DEMO_DIR)/tiny --seed 0
	$(BIN)/npuserve generate --model $(DEMO_DIR)/tiny --prompt "The capital of France is" --max-tokens 16

clean:
	rm -rf $(DEMO_DIR) .mypy_cache .ruff_cache .pytest_cache
