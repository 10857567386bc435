# sandkeep — two commands do all the set-up on a fresh machine:
#   make demo   the main job: the local demo
#   make test   lint, types and every test (unit, property, real filesystem, real processes, real API server),
#               then the end-to-end suite on a real node (kubelet + containerd, the image, the chart, Prometheus)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export SANDKEEP_TOOLS_DIR ?= $(CURDIR)/.cache/tools
TOOLS_BIN := $(SANDKEEP_TOOLS_DIR)/bin
export PATH := $(CURDIR)/$(VENV)/bin:$(TOOLS_BIN):$(PATH)
PYTEST_WORKERS ?= 2

.PHONY: all venv protos rmtree deps demo-deps tools demo-tools lint types test test-fast e2e e2e-nodes demo demo-node node cluster bench clean image \
	release registry
# What the demo runs; `make tools` adds kubelet, kube-scheduler, helm, promtool, prometheus, the OCI registry and
# crane for the tests and `make release`, and krew (tests/apiserver/test_krew.py).
DEMO_TOOLS := kube-apiserver kube-controller-manager kubectl etcd

all: test

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

## The CSI node plugin's gRPC modules (controller/csi/proto/, git-ignored), generated from pinned .proto files by
## the venv's grpcio-tools; instant when already generated. Part of `venv`, so every target that runs the package
## has them.
protos: $(STAMP)
	bash hack/protos.sh $(PY)

## The compiled walker (rmtree/), beside the venv's interpreter where fsdelete.py looks for it; instant when built.
rmtree: $(STAMP)
	bash hack/rmtree.sh $(VENV)/bin/sandkeep-rmtree

venv: $(STAMP) protos rmtree

## The Debian packages the tests (and the real node, and the image build) need; installed when missing (as root).
deps:
	bash hack/deps.sh test

demo-deps:
	bash hack/deps.sh demo

## Build every Go tool from pinned modules: the control plane's, the real node's (kubelet, kube-scheduler), helm,
## promtool, prometheus, CNCF Distribution's registry, crane and krew (cached; instant when built).
tools:
	bash hack/tools/build.sh >/dev/null

## Only what `make demo` runs: kube-apiserver, kube-controller-manager, kubectl and etcd.
demo-tools:
	bash hack/tools/build.sh $(DEMO_TOOLS) >/dev/null

## Build the sandkeep image from the Dockerfile with buildah (no Docker, no registry; cached by a hash of its inputs)
## into a docker archive for `ctr -n k8s.io images import`; prints the archive's path and the image reference.
image: venv
	bash hack/image.sh

## Build the image, push it to REGISTRY (host[:port][/path]) as sandkeep:VERSION, package the chart at VERSION with
## that image's digest as its default and push it to oci://REGISTRY/charts; prints what it pushed.
## RELEASE_ARGS=--plain-http for a registry without TLS (e.g. `make registry`'s).
release: venv tools
	@test -n "$(VERSION)" -a -n "$(REGISTRY)" || { echo "usage: make release VERSION=x.y.z REGISTRY=host[:port][/path]"; exit 2; }
	$(PY) -m hack.release --version $(VERSION) --registry $(REGISTRY) $(RELEASE_ARGS)

## A local OCI registry (CNCF Distribution, plain HTTP) until Ctrl-C; REGISTRY_ADDR=host:port to choose where.
registry: venv tools
	$(PY) -m hack.registry $(if $(REGISTRY_ADDR),--addr $(REGISTRY_ADDR))

lint: venv
	$(VENV)/bin/ruff check controller tests hack
	$(VENV)/bin/ruff format --check controller tests hack
	$(VENV)/bin/lint-imports

types: venv
	$(VENV)/bin/mypy

## Everything: lint, types, the whole suite against real directories, processes and a real API server, and
## beside it the end-to-end suite on a real node (hack/test_all.sh: its output is printed when both are done).
test: deps venv tools lint types
	VENV=$(VENV) PYTEST_WORKERS=$(PYTEST_WORKERS) PYTEST_ARGS="$(PYTEST_ARGS)" E2E_ARGS="$(E2E_ARGS)" hack/test_all.sh

## The end-to-end suite alone: a real node (kubelet, containerd, kube-scheduler) joins the local control plane,
## the image built from the Dockerfile runs the chart's Pods, a real Prometheus scrapes them and pages.
e2e: deps venv tools
	$(VENV)/bin/pytest -m 'e2e and not nodes' $(E2E_ARGS)

## The stories of four real nodes (tests/node/test_nodes.py, about 13 min): each agent deletes only its own
## node's sandboxes, a drain, a full disk on one node, a node lost and back, an agent killed, two agents on a
## node, a rollout, the controller leader's node lost. Not part of `make test`; CI runs it after.
e2e-nodes: deps venv tools
	$(VENV)/bin/pytest -m nodes -p no:cacheprovider $(E2E_ARGS)

## The same story as Pods on a real node, narrated: the end-to-end suite with its steps shown live (~5 min).
demo-node: deps venv tools
	$(VENV)/bin/pytest -m 'e2e and not nodes' -s -q -p no:cacheprovider $(E2E_ARGS)

## A local control plane with NODES real, Ready nodes (default 1, at most 4) until Ctrl-C (`export KUBECONFIG=...`
## is printed).
NODES ?= 1
node: deps venv tools
	$(PY) -m hack.localnode --nodes $(NODES)

## The suite without the Go tools' build step (they must already be built).
test-fast: venv
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The main job: the whole story on a local control plane, with the controller and two node agents (~2 min).
demo: demo-deps venv demo-tools
	$(PY) -m hack.demo $(DEMO_ARGS)

## The single-host mode alone (no cluster, no Go tools): retain, pin, ls, sweep on a temporary root.
.PHONY: demo-standalone
demo-standalone: venv
	$(PY) hack/demo_standalone.py

## Start a local control plane and print how to point kubectl at it (Ctrl-C stops it).
cluster: venv tools
	$(PY) -m hack.localcluster

bench: venv tools
	$(PY) hack/bench/delete.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache controller/csi/proto
