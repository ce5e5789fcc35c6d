"""Fixtures live in tests/fixtures/, one module per real service they start.

Each test session gets a base folder of its own (``/tmp/llmbatch-tests-*``) instead of
pytest's shared ``/tmp/pytest-of-<user>/pytest-N``, which every new pytest session
sets back to 0700 (two sessions overlapping on one machine once took a running
session's Postgres data away so). A passing session's folder is removed at its end,
with the Postgres data its stacks keep outside it (as root, in /var/lib/llm-batch:
llmbatch.devstack.postgres_home); a failing one's stays, with the servers' logs, and
says where.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from llmbatch.devstack.postgres_home import remove_tree

pytest_plugins = [
    "tests.fixtures.stack",
    "tests.fixtures.postgres_db",
    "tests.fixtures.buckets",
    "tests.fixtures.model",
    "tests.fixtures.workers",
    "tests.fixtures.tls",
    "tests.fixtures.api_server",
    "tests.fixtures.embed_worker",
    "tests.fixtures.tables",
    "tests.fixtures.openai_server",
]

# The fixtures that start a real server or engine (Temporal, Postgres, S3, vLLM, an
# OpenAI-compatible server, a built wheel's venv) or need one running. A test that
# uses any of them, directly or through another fixture, is in the stack tier
# (marked ``stack``); every other test is in the fast tier, ``make test-fast``.
SERVER_FIXTURES = frozenset(
    {
        "stack_settings", "stack", "pg_dsn", "s3_client", "bucket", "storage_settings",
        "empty_db_dsn", "ledger_dsn", "ledger_pool", "table_db", "tiny_model_path",
        "engine", "temporal_client", "cpu_workers", "api_server", "api_pool",
        "openai_server", "gateway", "embed_worker", "tls_proxy", "orchestration_client",
        "installed", "pool",
    }
)  # fmt: skip

# The base folder this file made for the session (none when --basetemp was given).
_OWN_BASETEMP = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    # Only the controlling session; --basetemp given on the command line is kept.
    if config.option.basetemp is None:
        config.option.basetemp = tempfile.mkdtemp(prefix="llmbatch-tests-")
        config.stash[_OWN_BASETEMP] = Path(config.option.basetemp)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.stack)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    own = session.config.stash.get(_OWN_BASETEMP, None)
    if own is None:
        return
    if exitstatus == 0:
        remove_tree(own)
    else:
        session.config.get_terminal_writer().line(f"test folders and server logs: {own}")
