"""The job spec reference: :class:`llmbatch.contract.spec.JobSpec` from its JSON Schema."""

from __future__ import annotations

import json
from typing import Any

from llmbatch.contract.spec import JobSpec
from llmbatch.reference.markdown import code, page, prose, table


def render() -> str:
    schema = JobSpec.model_json_schema()
    definitions: dict[str, Any] = schema.get("$defs", {})
    sections = [_model("JobSpec", schema)]
    sections += [_model(name, d) for name, d in sorted(definitions.items())]
    full = json.dumps(schema, indent=2, sort_keys=True)
    sections.append(f"## The whole JSON Schema\n\n```json\n{full}\n```\n")
    return page(
        "Job spec",
        "A job is started with one JSON object, the JobSpec: `llm-batch submit` builds it "
        "from its options, and a service in any language sends it to `BatchJobWorkflow` "
        "(see [Starting jobs from other services](../guides/other-services.md)). "
        "`llm-batch schema` prints the JSON Schema below. Unknown keys are refused.",
        sections,
    )


def _model(name: str, schema: dict[str, Any]) -> str:
    parts = [f"## {name}\n"]
    if schema.get("description"):
        parts.append(prose(schema["description"]) + "\n")
    if "enum" in schema:
        parts.append("One of " + ", ".join(code(json.dumps(v)) for v in schema["enum"]) + ".\n")
    properties: dict[str, Any] = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", []))
        rows = [
            (
                code(field) + (" (required)" if field in required else ""),
                _type(prop),
                code(json.dumps(prop["default"])) if "default" in prop else "",
                _describe(prop),
            )
            for field, prop in properties.items()
        ]
        parts.append(table(["Field", "Type", "Default", "Description"], rows))
    return "\n".join(parts)


def _type(prop: dict[str, Any]) -> str:
    if "$ref" in prop:
        name = prop["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "const" in prop:
        return code(json.dumps(prop["const"]))
    if "enum" in prop:
        return " \\| ".join(code(json.dumps(v)) for v in prop["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in prop:
            return " or ".join(_type(p) for p in prop[key])
    kind = prop.get("type", "any")
    if kind == "array" and "items" in prop:
        return f"list of {_type(prop['items'])}"
    if kind == "object" and isinstance(prop.get("additionalProperties"), dict):
        return f"map of {_type(prop['additionalProperties'])}"
    return str(kind)


_LIMITS = (
    ("minimum", ">="),
    ("exclusiveMinimum", ">"),
    ("maximum", "<="),
    ("exclusiveMaximum", "<"),
    ("minLength", "length >="),
    ("maxLength", "length <="),
    ("minItems", "items >="),
    ("maxItems", "items <="),
    ("pattern", "matches"),
)


def _describe(prop: dict[str, Any]) -> str:
    text = prose(prop.get("description"))
    limits = [f"{label} {code(str(prop[key]))}" for key, label in _LIMITS if key in prop]
    for option in prop.get("anyOf", []):
        limits += [f"{label} {code(str(option[key]))}" for key, label in _LIMITS if key in option]
    if limits:
        text = f"{text} ({'; '.join(limits)})".strip()
    return text
