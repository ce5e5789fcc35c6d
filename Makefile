# The two commands the README starts with.
VENV ?= .venv
PYTEST_ARGS ?=

# MkDocs Material prints a notice about MkDocs 2.0 on every run; it is not ours to act on.
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo test lint docs docs-build

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

# The docs site on http://127.0.0.1:8000, rebuilt as pages change. `llm-batch dev up`
# puts the OpenAI Batch API on 8000 when it is free: then `make docs DOCS_ADDR=127.0.0.1:8001`.
DOCS_ADDR ?= 127.0.0.1:8000
docs: setup
	$(VENV)/bin/mkdocs serve -a $(DOCS_ADDR)

# What CI builds: --strict fails on a broken link or a page missing from the nav.
docs-build: setup
	$(VENV)/bin/mkdocs build --strict
