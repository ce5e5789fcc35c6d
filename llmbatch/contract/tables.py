"""Database table URIs: a Postgres table or read-only query as a job's input, a table
as its output. Pure parsing (no I/O), shared by the job spec's validation, which runs
in workflows, and :mod:`llmbatch.tables`.

Forms::

    postgresql://[user@]host[:port]/database?table=[schema.]name
    postgresql://[user@]host[:port]/database?query=SELECT%20...   (input only)

The password never travels in a URI (it would land in the spec, the workflow history
and the ledger): the worker's environment gives it (``PGPASSWORD``, a pgpass file).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from llmbatch.errors import LlmBatchError

TABLE_SCHEMES = ("postgresql", "postgres")
# URI parameters a table URI may carry besides table/query (libpq's TLS choice).
_OPTIONAL_PARAMS = ("sslmode",)
# A plain identifier or a double-quoted one, with an optional schema before a dot.
_IDENT = r'(?:[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+")'
_TABLE_NAME = re.compile(rf"^(?:({_IDENT})\.)?({_IDENT})$")
# A query must start as a read query does; the read-only transaction it runs in
# refuses anything that writes all the same (a function that inserts, nextval).
_READ_QUERY = re.compile(r"^\s*(?:select|with|values|table)\b", re.IGNORECASE)


class TableUriError(LlmBatchError, ValueError):
    """A table URI that can never be used as written; the message says why in a line."""


@dataclass(frozen=True)
class TableUri:
    """A parsed table URI. ``table`` is ``(schema, name)`` unquoted, or None for a query."""

    uri: str
    host: str
    port: int
    database: str
    user: str | None
    table: tuple[str, str] | None
    query: str | None
    sslmode: str | None

    @property
    def dsn(self) -> str:
        """The libpq/asyncpg DSN, without a password (the environment supplies one)."""
        user = f"{self.user}@" if self.user else ""
        tls = f"?sslmode={self.sslmode}" if self.sslmode else ""
        return f"postgresql://{user}{self.host}:{self.port}/{self.database}{tls}"

    @property
    def resource(self) -> str:
        """What the allowed-tables setting is matched against: ``host:port/db/schema.table``,
        or ``host:port/db/*`` for a query (which may read any table of the database, so
        only a pattern granting the whole database allows it)."""
        what = "*" if self.table is None else f"{self.table[0]}.{self.table[1]}"
        return f"{self.host}:{self.port}/{self.database}/{what}"

    @property
    def qualified(self) -> str:
        """The table's name quoted for SQL (identifiers cannot be bound parameters)."""
        if self.table is None:
            raise TableUriError(f"{self.uri} names a query, not a table")
        return f"{quote_ident(self.table[0])}.{quote_ident(self.table[1])}"

    @property
    def display(self) -> str:
        """For messages: where, and which table (a query shown only as ``query``)."""
        what = "query" if self.table is None else f"{self.table[0]}.{self.table[1]}"
        return f"postgresql://{self.host}:{self.port}/{self.database} ({what})"


def is_table_uri(uri: str) -> bool:
    """Whether ``uri`` names a database table or query rather than a file."""
    scheme, sep, _ = uri.partition("://")
    return bool(sep) and scheme.lower() in TABLE_SCHEMES


def quote_ident(name: str) -> str:
    """``name`` as a quoted SQL identifier (doubling any quote in it)."""
    return '"' + name.replace('"', '""') + '"'


def _unquote_ident(part: str) -> str:
    if part.startswith('"'):
        return part[1:-1].replace('""', '"')
    # Unquoted identifiers fold to lower case in Postgres.
    return part.lower()


def parse_table_uri(uri: str, *, output: bool = False) -> TableUri:
    """Parse a table URI; raises :class:`TableUriError` with a one-line reason."""
    parts = urlsplit(uri)
    if parts.scheme.lower() not in TABLE_SCHEMES:
        raise TableUriError(f"{uri!r} is not a postgresql:// URI")
    if parts.password is not None:
        raise TableUriError(
            "the table URI carries a password; remove it (it would be stored in the job's "
            "spec and history) and give it to the workers as PGPASSWORD or a pgpass file"
        )
    if not parts.hostname:
        raise TableUriError(f"table URI {_shown(uri)} names no host")
    try:
        port = parts.port or 5432
    except ValueError as exc:
        raise TableUriError(f"table URI {_shown(uri)}: {exc}") from None
    database = unquote(parts.path.lstrip("/"))
    if not database or "/" in database:
        raise TableUriError(f"table URI {_shown(uri)} must name one database: host:port/db")
    params = dict(parse_qsl(parts.query, keep_blank_values=True))
    unknown = sorted(set(params) - {"table", "query", *_OPTIONAL_PARAMS})
    if unknown:
        raise TableUriError(
            f"table URI {_shown(uri)} has unknown parameter(s) {', '.join(unknown)}; "
            "give ?table=[schema.]name or ?query=SELECT ..."
        )
    table, query = params.get("table"), params.get("query")
    if (table is None) == (query is None):
        raise TableUriError(f"table URI {_shown(uri)} needs one of ?table= or ?query=")
    parsed_table = None
    if table is not None:
        match = _TABLE_NAME.match(table.strip())
        if match is None:
            raise TableUriError(f"table URI {_shown(uri)}: {table!r} is not a table name")
        schema, name = match.groups()
        parsed_table = (_unquote_ident(schema) if schema else "public", _unquote_ident(name))
    if query is not None:
        if output:
            raise TableUriError("an output must name a table (?table=), not a query")
        query = query.strip().removesuffix(";").strip()
        if not _READ_QUERY.match(query) or ";" in query:
            raise TableUriError(
                "the input query is not read-only: give one SELECT (or WITH ... SELECT) "
                "statement; it runs in a read-only transaction"
            )
    return TableUri(
        uri=uri,
        host=parts.hostname,
        port=port,
        database=database,
        user=unquote(parts.username) if parts.username else None,
        table=parsed_table,
        query=query,
        sslmode=params.get("sslmode"),
    )


def allowed(table: TableUri, patterns: list[str]) -> bool:
    """Whether one of the allowed-tables ``patterns`` (globs over
    ``host:port/db/schema.table``) covers ``table``."""
    return any(fnmatch.fnmatchcase(table.resource, p) for p in patterns)


def _shown(uri: str) -> str:
    # A query may be long: show where, not the whole statement.
    return uri.split("?", 1)[0]
