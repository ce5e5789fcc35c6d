"""Generation: what a generate attempt does with its engine's results.

``recorder`` buffers results and writes them to the ledger in batches fenced by the
attempt's lease, shares each dedup group's result with its repeats, offers new results
to the result cache, stages an embed job's vectors and keeps the attempt's engine usage.
It takes a :class:`~llmbatch.generation.recorder.RecordingContext` (the activities'
context is one), so nothing here imports ``activities``.

May import: ``llmbatch.config``, ``llmbatch.contract``, ``llmbatch.ledger``, ``llmbatch.dedup``,
``llmbatch.engine.base`` and ``llmbatch.engine.requests``, ``llmbatch.formats`` and
``llmbatch.telemetry``; never ``activities`` or ``workflows``.
"""
