"""Deduplication: one home for "have we answered this request before?".

``keys`` derives request keys (what makes two requests the same) and cache keys
(the same request of the same weights); ``result_cache`` is the cross-job result cache
in Postgres; ``leads`` is the SQL of in-job deduplication (one leader per distinct
request), with the part of the register statement that answers new items from the
job's leads and the cache; ``waits`` is how a prepare step waits for other shards'
leads. What a shard decides with them is the answer stage's
(:mod:`llmbatch.stages.answer`), which the stages after it record.

May import: ``llmbatch.contract`` and ``llmbatch.ledger``; never ``llmbatch.engine``
(the engine imports ``keys``), storage, the stages or activities. Submodules are not
imported here, so the engine can take ``keys`` alone.
"""
