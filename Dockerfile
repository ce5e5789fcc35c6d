# One image for both workers; the GPU worker's image adds CUDA vLLM (LLMBATCH_EXTRA=gpu).
FROM python:3.11-slim
ARG LLMBATCH_EXTRA=gpu
WORKDIR /app
COPY pyproject.toml README.md ./
COPY llmbatch ./llmbatch
COPY workflows ./workflows
COPY activities ./activities
COPY workers ./workers
COPY migrations ./migrations
RUN pip install --no-cache-dir -e ".[${LLMBATCH_EXTRA}]"
ENTRYPOINT ["llm-batch"]
