"""Splitting a stream of bytes into records, in one pass with bounded memory.

A JSONL record is a line. A CSV record ends at a newline outside quotes, where
"quotes" follow Python's ``csv`` module exactly: a ``"`` opens a quoted field only at
the start of a field, ``""`` inside one is an escaped quote, and a quote in the middle
of an unquoted field is a plain character. Planning and reading use this same
scanner, so they always agree on where records start and end.

The scanner keeps a record's bytes only up to a limit (none while planning), so one
huge line, or a quote left open that swallows the rest of a file, costs no memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

_NEWLINE = b"\n"
_QUOTE = b'"'
_WHITESPACE = frozenset(b" \t\r\n\x0b\x0c")

# Where a CSV scan stands, between two bytes.
_FIELD_START = 0  # the next byte starts a field
_UNQUOTED = 1  # inside an unquoted field (quotes are plain characters)
_QUOTED = 2  # inside a quoted field (newlines are data)
_QUOTE_IN_QUOTED = 3  # just read a quote inside a quoted field: "" or the field's end


@dataclass(slots=True)
class Record:
    """Bytes ``[start, end)`` of the input (``end`` after the newline, if any)."""

    start: int
    end: int
    line: int  # 1-based line number of the record's first line
    blank: bool  # only whitespace: not a row
    data: bytes | None  # the bytes, when kept and within the limit


def iter_chunks(reader: BinaryIO, chunk_bytes: int) -> Iterator[bytes]:
    """Read ``reader`` to its end in chunks, then close it."""
    try:
        while chunk := reader.read(chunk_bytes):
            yield chunk
    finally:
        reader.close()


def _csv_advance(buf: bytes, pos: int, end: int, state: int, delimiter: int) -> int:
    """The CSV state after ``buf[pos:end]`` (which holds no newline), from ``state``.

    Jumps from quote to quote with ``bytes.find``, so lines without quotes cost one
    search, and long quoted fields are not walked byte by byte.
    """
    field_quote = bytes((delimiter,)) + _QUOTE
    while pos < end:
        if state == _FIELD_START:
            if buf[pos] == 0x22:
                state, pos = _QUOTED, pos + 1
                continue
            state = _UNQUOTED
        if state == _UNQUOTED:
            # Only a delimiter followed by a quote can open a quoted field.
            i = buf.find(field_quote, pos, end)
            if i < 0:
                return _FIELD_START if buf[end - 1] == delimiter else _UNQUOTED
            state, pos = _QUOTED, i + 2
        elif state == _QUOTED:
            i = buf.find(_QUOTE, pos, end)
            if i < 0:
                return _QUOTED
            state, pos = _QUOTE_IN_QUOTED, i + 1
        else:  # _QUOTE_IN_QUOTED
            c = buf[pos]
            if c == 0x22:
                state = _QUOTED  # "" is an escaped quote
            elif c == delimiter:
                state = _FIELD_START
            else:
                state = _UNQUOTED  # csv keeps text after a closing quote as plain text
            pos += 1
    return state


def scan_records(
    chunks: Iterable[bytes],
    *,
    csv_delimiter: str | None = None,
    offset: int = 0,
    line: int = 1,
    keep_bytes: int | None = None,
) -> Iterator[Record]:
    """Every record in ``chunks`` (a stream starting at byte ``offset``, line ``line``).

    ``csv_delimiter`` set means CSV records, else lines. With ``keep_bytes``, records
    of at most that many bytes come with their ``data``; longer ones with ``None``.
    """
    csv_mode = csv_delimiter is not None
    delimiter = ord(csv_delimiter) if csv_delimiter is not None else 0
    keep = keep_bytes is not None
    limit = keep_bytes or 0
    state = _FIELD_START
    rec_start, rec_line = offset, line
    blank = True
    pieces: list[bytes] = []
    kept = 0
    over = False
    base = offset  # absolute offset of the current chunk
    for chunk in chunks:
        n = len(chunk)
        pos = 0
        while pos < n:
            nl = chunk.find(_NEWLINE, pos)
            stop = n if nl < 0 else nl + 1
            content_end = n if nl < 0 else nl
            if blank and (chunk[pos] not in _WHITESPACE or chunk[pos:stop].strip()):
                blank = False
            if csv_mode and content_end > pos:
                state = _csv_advance(chunk, pos, content_end, state, delimiter)
            if keep and not over:
                kept += stop - pos
                if kept > limit:
                    over, pieces = True, []
                else:
                    pieces.append(chunk[pos:stop])
            if nl < 0:
                break  # the line goes on in the next chunk
            line += 1
            pos = stop
            if state == _QUOTED:
                continue  # a newline inside a quoted field is data
            state = _FIELD_START
            data = b"".join(pieces) if keep and not over else None
            yield Record(rec_start, base + stop, rec_line, blank, data)
            rec_start, rec_line = base + stop, line
            blank, pieces, kept, over = True, [], 0, False
        base += n
    if base > rec_start:  # the last record has no final newline
        data = b"".join(pieces) if keep and not over else None
        yield Record(rec_start, base, rec_line, blank, data)
