"""A shard's item path, one way: a module per stage, in the order an item meets them.

``read`` (the input's rows → :class:`~llmbatch.formats.records.StagedRow`, with item
ids) → ``render`` (rows → :class:`~llmbatch.formats.records.StagedRequest`, each with
its request key, and the rows that can never run) → ``answer`` (in-job deduplication
and the result cache: which requests are answered already and by what, who leads the
rest; it decides and writes no item) → ``register`` (the ledger's rows: pending,
answered or dead; what is left staged for generate) → ``generate`` (a generate
attempt's engine loop over its requests) → ``record`` (engine results and answers
into the ledger, buffered, fenced by the attempt's lease) → ``encode`` (ledger rows
into output bytes).

Each stage takes what the one before hands it and hands the next, and imports nothing
that imports it back. Activities are thin adapters over them: ``prepare_shard``
reads, renders, answers and registers; ``generate`` runs a generate attempt, whose
claimed requests the answer stage groups and answers (the cache, other shards' leads,
asked again for a request another shard still leads) before and while the engine
loop runs the rest, and which records; the write step encodes. The answer stage
returns decisions and never calls the stages after it.

``context`` is what the stages need of the worker they run in (the activities'
context is one), ``drain`` how a worker's stop reaches an engine loop.

May import: ``llmbatch.config``, ``llmbatch.contract``, ``llmbatch.ledger``,
``llmbatch.dedup``, ``llmbatch.engine`` (its interface, requests and errors),
``llmbatch.formats``, ``llmbatch.rendering``, ``llmbatch.storage``,
``llmbatch.tables``, ``llmbatch.telemetry`` and ``llmbatch.remote.pause``; never
``activities``, ``workflows`` or ``workers``. Submodules are not imported here.
"""
