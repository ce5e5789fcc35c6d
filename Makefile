# The two commands the README starts with.
VENV ?= .venv
PYTEST_ARGS ?=

# MkDocs Material prints a notice about MkDocs 2.0 on every run; it is not ours to act on.
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo test test-fast lint docs docs-build k8s-render k8s-check

setup:
	./scripts/setup.sh

demo: setup
	$(VENV)/bin/llm-batch demo

# Two test processes (pytest-xdist), a whole file at a time, each with a stack of its
# own: most tests wait on servers and workers, so two share the 2 cores well (a full
# run took 54 min in one process, 38 in two). TEST_PROCESSES=0 runs them in this one.
TEST_PROCESSES ?= 2
test: setup
	$(VENV)/bin/python -m pytest -n $(TEST_PROCESSES) --dist loadfile $(PYTEST_ARGS)

# The fast tier, for the inner loop: every test that needs no server or engine (no
# Temporal, Postgres, S3 or vLLM; tests/conftest.py marks the others `stack`), in one
# process, in about a minute.
test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not stack and not slow" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy llmbatch tests benchmarks

# The docs site on http://127.0.0.1:8000, rebuilt as pages change. `llm-batch dev up`
# puts the OpenAI Batch API on 8000 when it is free: then `make docs DOCS_ADDR=127.0.0.1:8001`.
DOCS_ADDR ?= 127.0.0.1:8000
docs: setup
	$(VENV)/bin/mkdocs serve -a $(DOCS_ADDR)

# What CI builds: --strict fails on a broken link or a page missing from the nav.
docs-build: setup
	$(VENV)/bin/mkdocs build --strict

# Kubernetes manifests (deploy/k8s): rendered offline with kubectl's kustomize.
K8S_OVERLAY ?= gke-spot

k8s-render:
	kubectl kustomize deploy/k8s/overlays/$(K8S_OVERLAY)

k8s-check: setup
	$(VENV)/bin/python -m pytest tests/deploy -q -p no:cacheprovider
