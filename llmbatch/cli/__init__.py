"""The ``llm-batch`` command line."""
