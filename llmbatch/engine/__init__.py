"""The engine: what turns a shard's requests into results.

``base`` is the interface the generate activity uses (:class:`BatchEngine`, no vLLM);
``vllm_engine`` the in-process vLLM engine; ``run_loop`` the bounded request loop
both engines share; ``requests`` the requests, results and sampling (vLLM imported
only to build its parameters); ``errors`` the errors of starting an engine;
``options`` what an engine is started with and vLLM's argument parser; ``cpu`` vLLM
on CPU (environment and memory sizing). ``parent_death`` makes the processes an engine
starts die with its worker. A remote endpoint's engine lands beside
``vllm_engine``, behind the same interface.

May import: ``llmbatch.contract``, ``llmbatch.telemetry``, ``llmbatch.dedup.keys`` (the
weights fingerprint) and vLLM; never the ledger, storage, formats or activities.
Submodules are not imported here, so ``base`` and ``options`` come without the engine.
"""
