"""What the command modules of :mod:`llmbatch.cli` share; no command is declared here.

- ``common``: consoles, the one-line error idiom, JSON output, running a command's
  coroutine, the parameters many commands take, finding a job.
- ``options``: the job options of ``submit`` and ``schedule create``, and the spec
  they make.
- ``jobview``: how a job is shown (state, summary, results) and followed to its end.
- ``progress``: the live progress views ``jobview`` follows a job with.
- ``estimate``: ``submit --estimate``, the cost of a job on an endpoint.

``common``, ``options`` and ``progress`` are imported whenever the CLI starts (the
commands' signatures name what they declare), so at their top they import only the
standard library, typer, rich and the contract's plain modules (``choices``, ``names``,
``states``, ``progress``, ``uris``); the rest they import in the functions that need it.
``jobview`` and ``estimate`` are imported by a command when it runs.
"""
