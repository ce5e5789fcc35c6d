"""Prompt templates: chat messages whose contents are Jinja2 templates over row fields.

Templates render in Jinja2's immutable sandbox with ``StrictUndefined``: a row can
never reach Python internals, and a missing field is an error, not an empty string.
Row data is only ever a template's *context*, never template source.

A template is caller input too, and Jinja is a programming language: a template can
loop for hours or build a string of gigabytes. This module bounds what it can do in
one render (the size of its output, and of any string, list or number it builds
with an operator); :mod:`llmbatch.rendering.pool` bounds its time and memory by
rendering in a child process that is killed when a row overruns.

A field is written ``{{ text }}``; a field whose name is no Python name (``First
Name``, ``customer-id``) is written ``{{ row["First Name"] }}``: ``row`` is the whole
row, unless the row has a field called ``row`` of its own.

Error messages name the message that failed, the exception's type, the template line
and names taken from the template itself, never values from the row: they go into
the ledger, the dead-letter list and Temporal's history, which must not hold row data.
"""

from __future__ import annotations

import operator
import re
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import meta, nodes
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from llmbatch.contract.spec import ChatMessage
from llmbatch.errors import LlmBatchError
from llmbatch.rendering.limits import RenderLimits

# Jinja names the source of a template from a string "<template>" in tracebacks.
_TEMPLATE_FILENAME = "<template>"
# The name under which a template sees the whole row (``{{ row["First Name"] }}``).
ROW = "row"
# ``{{ First Name }}``: words apart inside one placeholder, most likely a field name
# with a space; the syntax error then says how to write it.
_SPACED_FIELD = re.compile(r"\{\{-?\s*([A-Za-z_]\w*(?:[ \t]+\w+)+)\s*-?\}\}")
# An integer a prompt needs is far smaller; ``9 ** 9 ** 9`` is minutes of CPU in C.
_MAX_INT_BITS = 4096


class TemplateError(LlmBatchError, ValueError):
    """A template does not compile, or a row cannot fill it. The message never
    quotes row values."""


class _OutputTooLarge(LlmBatchError):
    """A render (or a value it builds) went over ``RenderLimits.max_bytes``."""


def _length(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the operators that build large values bounded.

    ``'x' * 10**9`` would allocate a gigabyte in one C call (no time limit can stop
    it half-way), ``9 ** 9 ** 9`` compute for minutes: both fail at once here.
    ``optimized=False``: Jinja would otherwise fold constant expressions (and filter
    calls on constants) while *compiling*, in whichever process compiles.
    """

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            undefined=jinja2.StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            optimized=False,
        )
        self.max_bytes = max_bytes

    def call_binop(self, context: Context, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            for seq, times in ((left, right), (right, left)):
                size = _length(seq)
                if size is not None and isinstance(times, int) and size * times > self.max_bytes:
                    raise _OutputTooLarge(f"'*' would build a value over {self.max_bytes:,} bytes")
            return operator.mul(left, right)
        if operator_ == "+":
            sizes = (_length(left), _length(right))
            if None not in sizes and sum(s or 0 for s in sizes) > self.max_bytes:
                raise _OutputTooLarge(f"'+' would build a value over {self.max_bytes:,} bytes")
            return operator.add(left, right)
        if operator_ == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0:
                if abs(left) > 1 and max(abs(left).bit_length() - 1, 1) * right > _MAX_INT_BITS:
                    raise _OutputTooLarge(f"'**' would build a number over {_MAX_INT_BITS} bits")
            return operator.pow(left, right)
        return super().call_binop(context, operator_, left, right)


class PromptTemplate:
    """Compiled chat messages; ``fields`` are the row fields the templates use."""

    def __init__(self, messages: Sequence[ChatMessage], limits: RenderLimits | None = None) -> None:
        self.limits = limits or RenderLimits()
        self._env = _LimitedSandbox(self.limits.max_bytes)
        self._labels: list[str] = []
        self._roles: list[str] = []
        self._templates: list[jinja2.Template] = []
        # Names written in the templates: an error may quote these, nothing else.
        self._own_names: set[str] = set()
        fields: set[str] = set()
        # Whether a template names the whole row; only then is a context built for it.
        self._reads_row = False
        for index, message in enumerate(messages):
            label = f"message {index} ({message.role})"
            try:
                ast = self._env.parse(message.content)
                self._templates.append(self._env.from_string(ast))
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateError(
                    f"{label}: template syntax error on line {exc.lineno}: {exc.message}"
                    + _spaced_field_hint(message.content)
                ) from exc
            fields |= _fields_of(ast)
            self._reads_row |= ROW in meta.find_undeclared_variables(ast)
            self._own_names |= _names_in(ast)
            self._labels.append(label)
            self._roles.append(message.role)
        self.fields: frozenset[str] = frozenset(fields)
        #: The message being rendered, for a time limit that stops a render from outside.
        self.rendering: str | None = None

    def render(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """Render every message for one row; raises TemplateError naming the problem.

        Bounds the output, not the time: run it in :mod:`llmbatch.rendering.pool` for that.
        """
        rendered = []
        budget = self.limits.max_bytes
        context = {**row, ROW: row} if self._reads_row and ROW not in row else row
        for label, role, template in zip(self._labels, self._roles, self._templates, strict=True):
            self.rendering = label
            try:
                content = "".join(_bounded(template.generate(context), budget, self.limits))
            except _OutputTooLarge as exc:
                raise TemplateError(f"{label}: rendered prompt too large: {exc}") from None
            except Exception as exc:  # any failure is the row's: it dies, the shard goes on
                raise TemplateError(self._describe(label, row, exc)) from None
            budget -= len(content.encode())
            if budget < 0:
                raise TemplateError(
                    f"{label}: rendered prompt is over the {self.limits.max_bytes:,}-byte limit"
                )
            rendered.append({"role": role, "content": content})
        self.rendering = None
        return rendered

    def missing_fields(self, available: set[str] | frozenset[str]) -> list[str]:
        """Template fields that are not among ``available``, sorted."""
        return sorted(self.fields - set(available))

    def _describe(self, label: str, row: Mapping[str, Any], exc: BaseException) -> str:
        """What went wrong, in words from the template and the exception type only:
        Jinja's own messages quote values (``'dict object' has no attribute '<value>'``)."""
        where = _template_line(exc)
        at = f"{label}{f', line {where}' if where else ''}"
        if isinstance(exc, jinja2.UndefinedError):
            missing = sorted(f for f in self.fields if f not in row)
            if missing:
                return f"{at}: template field(s) missing in row: {', '.join(missing)}"
            name = self._quoted_own_name(str(exc))
            what = f" {name!r}" if name else ""
            return f"{at}: the template reads an undefined attribute or item{what} (UndefinedError)"
        if isinstance(exc, SecurityError):
            name = self._quoted_own_name(str(exc))
            what = f" {name!r}" if name else ""
            return f"{at}: the template touches an unsafe attribute or call{what} (SecurityError)"
        if isinstance(exc, OverflowError):
            return f"{at}: a value is too large for the sandbox (OverflowError)"
        if isinstance(exc, MemoryError):
            return f"{at}: rendering ran out of its memory limit (MemoryError)"
        return f"{at}: rendering failed ({type(exc).__name__})"

    def _quoted_own_name(self, message: str) -> str | None:
        """A name quoted in Jinja's ``message`` that the template itself contains."""
        quoted = message.split("'")[1::2]
        for name in reversed(quoted):  # Jinja names the attribute last
            if name in self._own_names:
                return name
        return None


def _bounded(chunks: Iterator[str], budget: int, limits: RenderLimits) -> Iterator[str]:
    """``chunks`` until their size passes ``budget`` (characters: never more than
    their UTF-8 bytes, so the exact check after the join is the one that counts)."""
    for chunk in chunks:
        budget -= len(chunk)
        if budget < 0:
            raise _OutputTooLarge(f"the output passed the {limits.max_bytes:,}-byte limit")
        yield chunk


def _fields_of(ast: nodes.Template) -> set[str]:
    """The row fields a template reads: its free names, with ``row`` (the whole row)
    replaced by the fields it subscripts with a constant (``row["First Name"]``)."""
    fields = meta.find_undeclared_variables(ast)
    if ROW in fields:
        fields = fields - {ROW}
        for item in ast.find_all(nodes.Getitem):
            if isinstance(item.node, nodes.Name) and item.node.name == ROW:
                if isinstance(item.arg, nodes.Const) and isinstance(item.arg.value, str):
                    fields.add(item.arg.value)
    return fields


def _spaced_field_hint(source: str) -> str:
    """How to write the field a syntax error most likely came from, if one has a space."""
    found = _SPACED_FIELD.search(source)
    if found is None:
        return ""
    name = " ".join(found.group(1).split())
    return f'; a field whose name has a space is written {{{{ row["{name}"] }}}}'


def _names_in(ast: nodes.Template) -> set[str]:
    names: set[str] = set()
    for node in ast.find_all((nodes.Name, nodes.Getattr, nodes.Const)):
        if isinstance(node, nodes.Name):
            names.add(node.name)
        elif isinstance(node, nodes.Getattr):
            names.add(node.attr)
        elif isinstance(node, nodes.Const) and isinstance(node.value, str):
            names.add(node.value)
    return names


def _template_line(exc: BaseException) -> int | None:
    """The template line the exception came from (Jinja rewrites the traceback so
    that template frames carry the template's own line numbers)."""
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == _TEMPLATE_FILENAME:
            line = frame.lineno
    return line
