"""Deduplication: one home for "have we answered this request before?".

``keys`` derives request keys (what makes two requests the same) and cache keys
(the same request of the same weights); ``result_cache`` is the cross-job result cache
in Postgres; ``leads`` is the SQL of in-job deduplication (one leader per distinct
request) and ``coordination`` is how a generate attempt uses it (groups, leads, cache
hits) and how a prepare step answers before it (the job's leads, the cache, and a
short wait for other shards' leads).

May import: ``llmbatch.contract``, ``llmbatch.ledger``, ``llmbatch.formats.records``;
never ``llmbatch.engine`` (the engine imports ``keys``), storage or activities.
Submodules are not imported here, so the engine can take ``keys`` alone.
"""
