"""Fixtures live in tests/fixtures/, one module per real service they start."""

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
