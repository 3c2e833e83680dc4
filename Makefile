# The two commands a newcomer runs: `make demo` and `make test`. Both install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.npuserve-installed
DEMO_DIR := .demo

.PHONY: setup test lint typecheck unit conformance demo demo-down demo-offline clean

setup: $(STAMP)

# Reinstall only when the dependency list changes; the editable install picks up code changes by itself.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -P -m venv $(VENV)
	$(BIN)/python -P -m pip install --quiet --upgrade pip
	$(BIN)/python -P -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

lint: setup
	$(BIN)/ruff check .

# mypy sees the folders under their import names (npuserve.engine, npuserve.planning, ...) through a tree of links, as
# the editable install's import hook is invisible to it and `operator/` by path would clash with the stdlib.
TYPECHECK_TREE := build/typecheck
typecheck: setup
	@rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/npuserve
	@for f in npuserve/*.py npuserve/py.typed npuserve/catalog; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_TREE)/npuserve/; done
	@for p in engine planning operator loadgen sim; do ln -s "$(CURDIR)/$$p" $(TYPECHECK_TREE)/npuserve/$$p; done
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p npuserve

# --durations: where the suite's time goes, printed at the end of every run (CI's limit is 90 minutes).
unit: setup
	$(BIN)/pytest -q --durations=20

test: lint typecheck unit

# vLLM's own `vllm bench serve` against the engine, beside `npuserve bench` (tests/thirdparty/test_conformance.py).
# vLLM is a multi-GB install: it goes into a cached virtualenv of its own on the first run, never into make test.
conformance: setup
	NPUSERVE_CONFORMANCE=1 $(BIN)/pytest -q -s -m conformance tests/thirdparty

# The main job: a local cluster with Prometheus, helm install, the operator, an InferenceService served by real
# engine processes and tuned from their measured TTFT/TPOT.
demo: setup
	$(BIN)/python e2e/demo.py

# Everything `make demo` left: the cluster's processes (engines, Jobs and Prometheus included) and the demo's model.
demo-down:
	$(CLUSTER_PY) down
	rm -rf $(DEMO_DIR)

# The engine alone, offline: a dummy model and one generation (seconds, no cluster).
demo-offline: setup
	$(BIN)/npuserve model create-dummy --preset tiny --out $(DEMO_DIR)/tiny --seed 0
	$(BIN)/npuserve generate --model $(DEMO_DIR)/tiny --prompt "The capital of France is" --max-tokens 16

clean:
	rm -rf $(DEMO_DIR) .mypy_cache .ruff_cache .pytest_cache

# The local Kubernetes cluster for the e2e tests (e2e/README.md). Building and stopping need only the standard
# library; starting runs the process kubelet, which talks to the API server through the venv's kubernetes client.
CLUSTER_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) e2e/cluster/cluster.py
.PHONY: cluster-build cluster-up cluster-down
cluster-build:
	$(CLUSTER_PY) build
cluster-up: setup
	$(CLUSTER_PY) up
cluster-down:
	$(CLUSTER_PY) down
