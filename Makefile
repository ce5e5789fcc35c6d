# The two commands the README starts with.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup demo test lint k8s-render k8s-check

setup:
	./scripts/setup.sh

demo: setup
	$(VENV)/bin/llm-batch demo

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy llmbatch workflows activities workers

# Kubernetes manifests (deploy/k8s): rendered offline with kubectl's kustomize.
K8S_OVERLAY ?= gke-spot

k8s-render:
	kubectl kustomize deploy/k8s/overlays/$(K8S_OVERLAY)

k8s-check: setup
	$(VENV)/bin/python -m pytest tests/deploy -q -p no:cacheprovider
