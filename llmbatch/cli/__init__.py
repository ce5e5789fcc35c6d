"""The ``llm-batch`` command line.

Each module here is a command module: it declares one Typer ``app`` (a named group
such as ``dlq``, or top-level commands such as ``submit`` and ``status``), and
:mod:`llmbatch.cli.main` adds every ``app`` the same way. What the commands share
lives in :mod:`llmbatch.cli._support`, which declares no command.

The CLI starts light: ``llm-batch --help`` builds every command's options, so a
command module imports at its top only typer, rich, the support modules and the
contract's plain modules (:mod:`llmbatch.contract.choices` for the enums its options
take). Temporal, the settings, the contract's models, Postgres and storage are
imported in the function that runs the command (a test holds the help to that:
tests/llmbatch/cli/test_startup.py).
"""
