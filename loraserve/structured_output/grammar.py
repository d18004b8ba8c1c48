"""A constraint as an xgrammar Grammar, or a GrammarError that names what is wrong.

The API server builds the grammar to check a request before it accepts it; the
engine builds it again to compile it against the tokenizer. Both go through
`build_grammar`, so a request the server accepts is one the engine can compile.

xgrammar silently drops a few JSON-schema keywords (its output would then look
valid and break the schema), so a schema that uses one is refused here instead.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from loraserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

    from loraserve.config import StructuredOutputsConfig


class GrammarError(ValueError):
    """A constraint that cannot be turned into a grammar; the message says why."""


# The string formats xgrammar enforces; any other `format` it would ignore.
_SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords that xgrammar (0.2) accepts but does not enforce, with what they ask for.
_UNENFORCED_KEYWORDS = {
    "contains": "an item matching a schema",
    "minContains": "a number of matching items",
    "maxContains": "a number of matching items",
    "not": "a value not matching a schema",
    "if": "conditional schemas",
    "then": "conditional schemas",
    "else": "conditional schemas",
    "dependentRequired": "properties required by others",
    "dependentSchemas": "schemas applied by the presence of properties",
    "dependencies": "properties required by others",
}
# Where a schema holds subschemas: keyword -> how they are held.
_SUBSCHEMA_DICTS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_ONES = ("items", "additionalProperties", "propertyNames", "unevaluatedItems",
                   "unevaluatedProperties", "additionalItems")
# "[12:34:56] /path/file.cc:123: " and "Check failed: (...) is false: " in xgrammar's errors.
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false: )?")
# xgrammar (0.2) writes the characters of a string with minLength/maxLength as this
# class, which lets in raw control characters (JSON allows them only escaped): the
# output would not be JSON. Such rules get JSON's unescaped-character class instead.
_BOUNDED_STRING_RULE = re.compile(
    r'^(\S+_characters ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


def any_whitespace(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> bool:
    """Whether JSON may put any whitespace between its tokens."""
    return not (params.disable_any_whitespace or config.disable_any_whitespace)


def build_grammar(params: StructuredOutputsParams,
                  config: StructuredOutputsConfig) -> xgr.Grammar:
    """The grammar of the constraint; GrammarError when there is none."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind == "json":
            schema = _load_schema(params.json)
            check_schema(schema)
            grammar = xgr.Grammar.from_json_schema(
                params.json, any_whitespace=any_whitespace(params, config), strict_mode=True)
            return _json_strings_fixed(grammar)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=any_whitespace(params, config))
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(params.choice))
        if is_lark(params.grammar):
            return xgr.Grammar.from_lark(params.grammar)
        return xgr.Grammar.from_ebnf(params.grammar)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar's parse errors are the request's
        raise GrammarError(f"{_WHAT[kind]}: {clean_error(exc)}") from exc


_WHAT = {
    "json": "Invalid JSON schema",
    "json_object": "Invalid JSON object grammar",
    "regex": "Invalid regex",
    "choice": "Invalid choice",
    "grammar": "Invalid grammar",
}


def _json_strings_fixed(grammar: xgr.Grammar) -> xgr.Grammar:
    """The grammar with its length-bounded strings kept to JSON's characters."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = _BOUNDED_STRING_RULE.sub(
        lambda m: f"{m.group(1)}{_JSON_STRING_CHARACTER}{m.group(2)}", text)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without the C++ source location it starts with."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = _XGRAMMAR_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return text.strip()


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the choices (JSON's string escapes
    are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """Whether a grammar is written in Lark rather than EBNF: no line (comments
    aside) defines a rule with `::=`."""
    for line in grammar.splitlines():
        line = re.sub(r"(#|//).*$", "", line).strip()
        if "::=" in line:
            return False
    return True


def _load_schema(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"Invalid JSON schema: not valid JSON ({exc})") from exc


def check_schema(schema: Any, path: str = "#") -> None:
    """GrammarError for the first place where the schema asks for something that
    xgrammar would not enforce."""
    if not isinstance(schema, dict):
        if not isinstance(schema, bool):
            raise GrammarError(f"Invalid JSON schema: {path} must be an object or a boolean, "
                               f"got {type(schema).__name__}")
        return
    for keyword, what in _UNENFORCED_KEYWORDS.items():
        if keyword in schema:
            _refuse(keyword, what, path)
    if schema.get("uniqueItems") is True:
        _refuse("uniqueItems", "items that differ", path)
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        _refuse("allOf", "several schemas at once", path)
    types = schema.get("type")
    types = {types} if isinstance(types, str) else {
        t for t in types if isinstance(t, str)} if isinstance(types, list) else set()
    if "multipleOf" in schema and types != {"integer"}:
        _refuse("multipleOf", "multiples of a number that is not an integer", path)
    if "format" in schema and not (isinstance(schema["format"], str)
                                   and schema["format"] in _SUPPORTED_FORMATS):
        _refuse("format", f"the format {schema['format']!r}", path)
    if ("pattern" in schema or "format" in schema) and (
            "minLength" in schema or "maxLength" in schema):
        _refuse("minLength/maxLength", "a length together with a pattern or format", path)
    for keyword in _SUBSCHEMA_DICTS:
        children = schema.get(keyword)
        if isinstance(children, dict):
            for name, child in children.items():
                check_schema(child, f"{path}/{keyword}/{name}")
    for keyword in _SUBSCHEMA_LISTS:
        children = schema.get(keyword)
        if isinstance(children, list):
            for i, child in enumerate(children):
                check_schema(child, f"{path}/{keyword}/{i}")
    for keyword in _SUBSCHEMA_ONES:
        child = schema.get(keyword)
        if isinstance(child, dict):
            check_schema(child, f"{path}/{keyword}")
        elif isinstance(child, list) and keyword == "items":
            for i, item in enumerate(child):
                check_schema(item, f"{path}/{keyword}/{i}")


def _refuse(keyword: str, what: str, path: str) -> None:
    raise GrammarError(
        f"The JSON schema uses '{keyword}' at {path} ({what}), which the xgrammar backend "
        "does not enforce; the output could break the schema, so the request is refused.")
