from __future__ import annotations

import pytest

from llmbatch.contract.spec import ChatMessage
from llmbatch.templates import PromptTemplate, TemplateError


def template(*contents: str) -> PromptTemplate:
    return PromptTemplate([ChatMessage(role="user", content=c) for c in contents])


def test_renders_fields_and_lists_them() -> None:
    t = template("Company: {{ Company }}", "City: {{ City | upper }}")
    assert t.fields == {"Company", "City"}
    assert t.render({"Company": "Acme", "City": "Lyon"}) == [
        {"role": "user", "content": "Company: Acme"},
        {"role": "user", "content": "City: LYON"},
    ]
    assert t.missing_fields({"Company"}) == ["City"]


def test_missing_field_is_an_error_not_an_empty_string() -> None:
    with pytest.raises(TemplateError, match="field.s. missing in row: City"):
        template("{{ City }}").render({})


def test_sandbox_refuses_python_internals() -> None:
    with pytest.raises(TemplateError, match="unsafe"):
        template("{{ x.__class__.__mro__ }}").render({"x": 1})


def test_row_data_is_never_template_source() -> None:
    rendered = template("{{ text }}").render({"text": "{{ 7 * 7 }}"})
    assert rendered[0]["content"] == "{{ 7 * 7 }}"


def test_syntax_error_names_the_message() -> None:
    with pytest.raises(TemplateError, match=r"message 0 \(user\): template syntax error"):
        template("{{ unclosed")
