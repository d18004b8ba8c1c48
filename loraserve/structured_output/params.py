"""A request's structured-output constraint, with the fields and rules of vLLM's
StructuredOutputsParams: exactly one of `json` (a JSON schema), `regex`, `choice`,
`grammar` (EBNF/GBNF, or Lark) and `json_object`, plus the whitespace options.

A msgspec struct, so that it crosses to the engine core inside SamplingParams."""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

# The constraint fields, one of which a request sets.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    # A JSON schema. A dict is kept as its JSON text (key order is kept too: it is
    # the order in which the properties are generated).
    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # No whitespace between JSON tokens (xgrammar's any_whitespace=False).
    disable_any_whitespace: bool = False
    # Accepted as vLLM accepts them. The xgrammar backend already allows no property
    # a schema does not name (strict mode), and, as vLLM's xgrammar backend does,
    # applies no whitespace pattern.
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None  # "no JSON object constraint", not a constraint
        if self.json is not None and not isinstance(self.json, str):
            self.json = _json.dumps(self.json, ensure_ascii=False)
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but "
                             f"multiple are specified: {', '.join(given)}")
        if not given:
            raise ValueError("You must use one kind of structured outputs constraint "
                             f"({', '.join(CONSTRAINTS)}) but none is specified")
        if self.choice is not None and not self.choice:
            raise ValueError("choice must not be an empty list")

    @property
    def kind(self) -> str:
        """Which constraint this is: one of CONSTRAINTS."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint itself as text (the choices as a JSON list)."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return _json.dumps(value, ensure_ascii=False)
        return "" if self.kind == "json_object" else value

    def cache_key(self, any_whitespace: bool) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (whitespace only matters to JSON)."""
        kind = self.kind
        json_like = kind in ("json", "json_object")
        return kind, self.spec, any_whitespace and json_like
