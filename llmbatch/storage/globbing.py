"""Shell-style globs over ``/``-separated keys, shared by the S3 and local stores:
``*`` and ``?`` stay within one part, ``**`` spans any depth, and hidden names (``.x``,
``_x``) are skipped when a folder is listed.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


GLOB_CHARS = ("*", "?", "[")


def has_glob(text: str) -> bool:
    return any(c in text for c in GLOB_CHARS)


def hidden(relative: str) -> bool:
    """Whether any part of a path below a listed folder is hidden (``.x`` or ``_x``)."""
    return any(part.startswith((".", "_")) for part in relative.split("/") if part)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A regex for a shell-style glob over ``/``-separated keys: ``*`` and ``?`` stay
    within one part, ``[...]`` is a character class, a ``**`` part spans any depth."""
    # By hand: pyarrow.fs does no globbing, fnmatch's "*" crosses "/", and the
    # stdlib's glob.translate (these rules) comes only with Python 3.13.
    # fsspec.utils.glob_translate agrees with this, but fsspec is no dependency of
    # ours (only vLLM brings it), and these lines do not pay for one.
    out: list[str] = []
    segments = pattern.split("/")
    for n, segment in enumerate(segments):
        last = n == len(segments) - 1
        if segment == "**":
            out.append(".*" if last else "(?:[^/]*/)*")
            continue
        i = 0
        while i < len(segment):
            c = segment[i]
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif c == "[":
                close = segment.find("]", i + 2 if segment[i + 1 : i + 2] in ("!", "]") else i + 1)
                if close < 0:
                    out.append(re.escape(c))
                else:
                    body = segment[i + 1 : close]
                    if body.startswith("!"):
                        body = "^" + body[1:]
                    out.append("[" + body.replace("\\", "\\\\") + "]")
                    i = close
            else:
                out.append(re.escape(c))
            i += 1
        if not last:
            out.append("/")
    return re.compile("".join(out) + r"\Z", re.DOTALL)
