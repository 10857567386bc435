# sandkeep — two commands do all the set-up on a fresh machine:
#   make demo   the main job: the local demo
#   make test   lint, types and every test (unit, property, real filesystem, real processes, real API server)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export SANDKEEP_TOOLS_DIR ?= $(CURDIR)/.cache/tools
TOOLS_BIN := $(SANDKEEP_TOOLS_DIR)/bin
export PATH := $(CURDIR)/$(VENV)/bin:$(TOOLS_BIN):$(PATH)
PYTEST_WORKERS ?= 2

.PHONY: all venv tools lint types test test-fast demo cluster bench clean image

all: test

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

venv: $(STAMP)

## Build kube-apiserver, kube-controller-manager, kubectl, etcd, helm and promtool from pinned Go modules (cached; instant when built).
tools:
	bash hack/tools/build.sh >/dev/null

## Build the sandkeep image from the Dockerfile with buildah (no Docker, no registry; cached by a hash of its inputs)
## into a docker archive for `ctr -n k8s.io images import`; prints the archive's path and the image reference.
image:
	bash hack/image.sh

lint: venv
	$(VENV)/bin/ruff check controller tests hack
	$(VENV)/bin/ruff format --check controller tests hack

types: venv
	$(VENV)/bin/mypy

## Everything: lint, types, then the whole suite against real directories, processes and a real API server.
test: venv tools lint types
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The suite without the Go tools' build step (they must already be built).
test-fast: venv
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The main job: the whole story on a local control plane, with the controller and two node agents (~2 min).
demo: venv tools
	$(PY) hack/demo.py $(DEMO_ARGS)

## The single-host mode alone (no cluster, no Go tools): retain, pin, ls, sweep on a temporary root.
.PHONY: demo-standalone
demo-standalone: venv
	$(PY) hack/demo_standalone.py

## Start a local control plane and print how to point kubectl at it (Ctrl-C stops it).
cluster: venv tools
	$(PY) hack/localcluster.py

bench: venv tools
	$(PY) hack/bench/delete.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
