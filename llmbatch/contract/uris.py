"""Taking storage URIs apart: the one scheme parser, shared by the job spec's
validation (which runs in workflows, so no I/O here) and :mod:`llmbatch.storage`."""

from __future__ import annotations

# The schemes llm-batch reads and writes; a plain path counts as ``file``.
SUPPORTED_SCHEMES = ("s3", "file")


def split_scheme(uri: str) -> tuple[str | None, str]:
    """``(scheme, rest)`` of ``scheme://rest``, the scheme as written; ``(None, uri)``
    for a plain path. The one place a URI's scheme is taken apart: not urlsplit,
    because a key may hold ``?`` or ``#``, which are glob or plain characters here."""
    scheme, sep, rest = uri.partition("://")
    return (scheme, rest) if sep else (None, uri)


def scheme_of(uri: str) -> str:
    """``s3``, ``file`` (also for plain paths), or whatever else the URI names, in
    lower case (schemes are case-insensitive)."""
    scheme, _ = split_scheme(uri)
    return "file" if scheme is None else scheme.lower()


def has_parent_segment(uri: str) -> bool:
    """Whether any ``/``-separated part of the URI's path or key is ``..``: such a
    URI could climb out of the folder or prefix it seems to name."""
    return ".." in split_scheme(uri)[1].split("/")
