"""The OpenAI Batch API over HTTP (``llm-batch serve``): files, batches, API keys."""
