"""The guides of a forced tool choice, in vLLM's forms: a named function's arguments object, or for 'required' a list
of {"name", "parameters"} objects; each tool's parameters schema moved under one root with its references kept."""

from __future__ import annotations

import json
from typing import Any

from server.grammar_schema import DEFINITIONS, local_definition, pointer_to
from server.guide_spec import GuideSpec


def named_call_guide(parameters: dict[str, Any] | None) -> GuideSpec:
    """A named function's guide: its arguments, an instance of its parameters schema (any object where it has none)."""
    return GuideSpec("json", json.dumps(parameters or {"type": "object"}))


def required_calls_guide(tools: list[tuple[str, dict[str, Any] | None]], parallel: bool) -> GuideSpec:
    """'required''s guide: a list of at least one {"name", "parameters"} object, each one tool's name and an instance
    of its parameters (at most one without parallel calls). Each tool's schema becomes a definition of the list's
    schema, so its own references ('#' and its definitions) still name what they named."""
    definitions: dict[str, Any] = {}
    calls = []
    for index, (name, parameters) in enumerate(tools):
        root = f"tool{index}"
        definitions |= rebased(parameters or {"type": "object"}, root)
        calls.append({
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/{root}"}},
            "required": ["name", "parameters"],
        })  # fmt: skip
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1, "$defs": definitions}
    return GuideSpec("json", json.dumps(schema | ({} if parallel else {"maxItems": 1})))


def rebased(schema: dict[str, Any], root: str) -> dict[str, Any]:
    """A schema and its definitions as definitions of another schema: the schema as `root`, each definition as
    `root` + "." + its name, every local reference rewritten to match (others are left for the grammar to refuse)."""
    own = {section: schema.get(section) for section in DEFINITIONS}
    names = {(section, name) for section, defs in own.items() if isinstance(defs, dict) for name in defs}

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: moved(value) for key, value in node.items() if key not in DEFINITIONS or node is not schema}
        reference = node.get("$ref")
        if reference == "#":
            out["$ref"] = "#" + pointer_to("", "$defs", root)
        elif (named := local_definition(reference)) in names:
            out["$ref"] = "#" + pointer_to("", "$defs", _moved_name(root, *named))
        return out

    result = {root: moved(schema)}
    for section, defs in own.items():
        if isinstance(defs, dict):
            result |= {_moved_name(root, section, name): moved(definition) for name, definition in defs.items()}
    return result


def _moved_name(root: str, section: str, name: str) -> str:
    """A definition's name once moved under `root`."""
    return f"{root}.{name}" if section == "$defs" else f"{root}.definitions.{name}"
