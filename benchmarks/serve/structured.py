"""Constrained requests of the serving benchmark: which requests of a run carry a
JSON schema (response_format), the schema, and whether an answer is JSON that the
schema accepts."""

from __future__ import annotations

import functools
import json
import random
from typing import Any

try:
    import jsonschema
except ImportError:  # then an answer is only checked to be JSON
    jsonschema = None

SCHEMA_NAME = "benchmark_record"
# A record with typed, bounded fields: every string, number and list has a bound,
# so a model with random weights (which writes any token the grammar allows)
# still closes the object within about a hundred tokens. Keywords only from those
# the server enforces (it refuses a schema with one that xgrammar would ignore).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "status": {"enum": ["active", "inactive", "pending"]},
        "verified": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                 "maxItems": 3},
    },
    "required": ["name", "age", "status", "verified", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: dict[str, Any] = {
    "type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": SCHEMA},
}
# What an answer was checked with: the schema, or (without jsonschema) only JSON.
CHECKED_WITH = "jsonschema" if jsonschema is not None else "json.loads"


def pick_constrained(num: int, fraction: float, rng: random.Random) -> list[bool]:
    """Which of num requests carry the schema: fraction of them (rounded, at least
    one for a fraction above 0), spread evenly over the run: the run is cut into
    that many equal stretches and one request is drawn from each."""
    if fraction <= 0:
        return [False] * num
    count = min(num, max(1, int(fraction * num + 0.5)))
    picked = [False] * num
    for k in range(count):
        picked[rng.randrange(k * num // count, (k + 1) * num // count)] = True
    return picked


def valid_answer(text: str) -> bool:
    """Whether text is JSON that the schema accepts (only JSON without jsonschema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema is None or _validator().is_valid(value)


@functools.cache
def _validator() -> Any:
    cls = jsonschema.validators.validator_for(SCHEMA)
    return cls(SCHEMA)
