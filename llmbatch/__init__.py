"""llm-batch: durable LLM batch inference on Temporal."""

__version__ = "0.1.0"
