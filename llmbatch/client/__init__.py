"""Clients of a running llm-batch: connecting to Temporal (TLS, API keys, the payload
codec), starting jobs and reading what they were started with (``temporal``), and the
Temporal Schedules that start jobs on a timetable (``schedules``), and the start of a
job's dead-letter workflow (``dead_letters``).

May import: ``llmbatch.config``, ``llmbatch.contract``, ``llmbatch.security`` and
``llmbatch.telemetry``; never the ledger, the engine, storage or activities (a client
holds no worker's parts).
"""
