from __future__ import annotations

import time
from typing import Any

import pytest

from llmbatch.contract.spec import ChatMessage
from llmbatch.rendering.limits import RenderLimits
from llmbatch.rendering.templates import PromptTemplate, TemplateError


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
    with pytest.raises(TemplateError, match=r"field\(s\) missing in row: City"):
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


def test_a_string_blow_up_fails_at_once_instead_of_allocating() -> None:
    started = time.monotonic()
    with pytest.raises(TemplateError, match="too large"):
        template("{{ text * n }}").render({"text": "ab", "n": 100_000_000})
    with pytest.raises(TemplateError, match="too large"):
        template("{{ 2 ** n }}").render({"n": 100_000_000})
    assert time.monotonic() - started < 1


def test_a_huge_range_is_a_template_error() -> None:
    with pytest.raises(TemplateError, match="OverflowError"):
        template("{% for i in range(n) %}.{% endfor %}").render({"n": 100_000_000})


def test_the_output_is_bounded_across_messages() -> None:
    limits = RenderLimits(max_bytes=1000)
    small = PromptTemplate([ChatMessage(role="user", content="{{ text }}")] * 2, limits)
    assert small.render({"text": "x" * 400})[1]["content"] == "x" * 400
    with pytest.raises(TemplateError, match=r"message 1 .*1,000-byte limit"):
        small.render({"text": "x" * 600})
    looping = PromptTemplate(
        [ChatMessage(role="user", content="{% for i in range(100000) %}{{ t }}{% endfor %}")],
        limits,
    )
    with pytest.raises(TemplateError, match="1,000-byte limit"):
        looping.render({"t": "y"})


def test_errors_name_template_words_never_row_values() -> None:
    secret = "4111-1111-1111-1111"
    cases: list[tuple[str, dict[str, Any]]] = [
        ("{{ labels[text] }}", {"labels": {"a": 1}, "text": secret}),  # Jinja quotes the key
        ("{{ text.missing }}", {"text": secret}),
        ("{{ text | int + [] }}", {"text": secret}),
        ("{{ x.__class__ }}", {"x": secret}),
    ]
    for content, row in cases:
        with pytest.raises(TemplateError) as failure:
            template("Ask about", content).render(row)
        message = str(failure.value)
        assert secret not in message and message.startswith("message 1 (user), line 1: ")
    with pytest.raises(TemplateError, match="attribute or item 'missing'"):
        template("{{ text.missing }}").render({"text": secret})


def test_a_field_whose_name_has_a_space_is_read_through_row() -> None:
    """The seeds' customers file has ``First Name``: ``row`` reaches it, and the plan's
    check of the input's fields sees the field itself, not ``row``."""
    template = PromptTemplate(
        [ChatMessage(role="user", content='{{ row["First Name"] }} at {{ Company }}')]
    )
    assert template.fields == {"First Name", "Company"}
    assert template.missing_fields({"Company"}) == ["First Name"]
    row = {"First Name": "Ann", "Company": "Cedar Blue Legal LLP"}
    assert template.render(row) == [{"role": "user", "content": "Ann at Cedar Blue Legal LLP"}]


def test_a_row_with_a_field_called_row_keeps_it() -> None:
    template = PromptTemplate([ChatMessage(role="user", content="{{ row }}")])
    assert template.render({"row": "seven"}) == [{"role": "user", "content": "seven"}]


def test_a_placeholder_with_a_space_says_how_to_write_the_field() -> None:
    with pytest.raises(TemplateError) as caught:
        PromptTemplate([ChatMessage(role="user", content="Hello {{ First Name }}!")])
    assert 'a field whose name has a space is written {{ row["First Name"] }}' in str(caught.value)
    with pytest.raises(TemplateError) as other:
        PromptTemplate([ChatMessage(role="user", content="Hello {{ name }")])
    assert "space" not in str(other.value)
