"""Prompt rendering: the Jinja prompt templates of a job (``templates``: sandboxed, with
limits on time and size, declared in ``limits``) and the process pool that renders them
isolated, so a runaway template is killed, not waited for (``pool``).

May import: ``llmbatch.contract`` only.
"""
