"""Prompt templates: chat messages whose contents are Jinja2 templates over row fields.

Templates render in Jinja2's immutable sandbox with ``StrictUndefined``: a row can
never reach Python internals, and a missing field is an error, not an empty string.
Row data is only ever a template's *context*, never template source.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmbatch.contract.spec import ChatMessage

_ENV = ImmutableSandboxedEnvironment(
    undefined=jinja2.StrictUndefined,
    autoescape=False,
    keep_trailing_newline=True,
)


class TemplateError(ValueError):
    """A template does not compile, or a row cannot fill it."""


class PromptTemplate:
    """Compiled chat messages; ``fields`` are the row fields the templates use."""

    def __init__(self, messages: Sequence[ChatMessage]) -> None:
        self._roles: list[str] = []
        self._templates: list[jinja2.Template] = []
        fields: set[str] = set()
        for index, message in enumerate(messages):
            try:
                ast = _ENV.parse(message.content)
                self._templates.append(_ENV.from_string(ast))
            except jinja2.TemplateSyntaxError as exc:
                raise TemplateError(
                    f"message {index} ({message.role}): template syntax error on line "
                    f"{exc.lineno}: {exc.message}"
                ) from exc
            fields |= meta.find_undeclared_variables(ast)
            self._roles.append(message.role)
        self.fields: frozenset[str] = frozenset(fields)

    def render(self, row: Mapping[str, Any]) -> list[dict[str, str]]:
        """Render every message for one row; raises TemplateError naming the problem."""
        rendered = []
        for role, template in zip(self._roles, self._templates, strict=True):
            try:
                content = template.render(row)
            except jinja2.UndefinedError as exc:
                raise TemplateError(f"template field missing in row: {exc.message}") from exc
            except jinja2.TemplateError as exc:
                raise TemplateError(f"template failed on row: {exc}") from exc
            rendered.append({"role": role, "content": content})
        return rendered

    def missing_fields(self, available: set[str] | frozenset[str]) -> list[str]:
        """Template fields that are not among ``available``, sorted."""
        return sorted(self.fields - set(available))
