# The two commands the README starts with.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup demo test lint

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
