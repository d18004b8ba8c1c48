"""JSON that may still be growing: its structure so far, and its text in the form
``json.dumps(value, ensure_ascii=False)`` gives, up to what is certain.

A streamed tool call sends its arguments piece by piece; rendering the arguments
seen so far this way gives, at every step, a prefix of what the whole arguments
render to (an unfinished number or literal renders as nothing yet, an unfinished
string as its characters so far). So the pieces streamed add up to exactly the
arguments a non-streamed answer returns.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

# A string's characters and whole escapes (the longest valid run from its start).
_STRING_BODY = re.compile(r'(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4}))*')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")
_HIGH_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}$")


class MalformedJSON(ValueError):
    """The text cannot be (the start of) a JSON value."""


@dataclass
class Node:
    """A JSON value in a text: `end` is None while it is unfinished. An object's
    `members` are (key, value) pairs, the value None until it starts; an array's
    `items` its values."""

    kind: str  # object, array, string, number or literal
    start: int
    end: int | None = None
    members: list[tuple[str, Node | None]] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)
    # A string's characters so far (decoded).
    text: str = ""

    @property
    def complete(self) -> bool:
        return self.end is not None


def skip_whitespace(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def parse(text: str, pos: int = 0) -> Node | None:
    """The JSON value that starts at `pos` (after whitespace), as far as the text
    goes; None when only whitespace is left. MalformedJSON when the text cannot
    continue into a JSON value."""
    pos = skip_whitespace(text, pos)
    if pos >= len(text):
        return None
    return _value(text, pos)


def _value(text: str, pos: int) -> Node:
    char = text[pos]
    if char == "{":
        return _object(text, pos)
    if char == "[":
        return _array(text, pos)
    if char == '"':
        return _string(text, pos)
    return _scalar(text, pos)


def _object(text: str, start: int) -> Node:
    node = Node("object", start)
    pos = skip_whitespace(text, start + 1)
    if text.startswith("}", pos):
        node.end = pos + 1
        return node
    while pos < len(text):
        if text[pos] != '"':
            raise MalformedJSON(f"expected a key at {pos}")
        key = _string(text, pos)
        if not key.complete:
            return node
        pos = skip_whitespace(text, key.end)
        if pos >= len(text):
            return node
        if text[pos] != ":":
            raise MalformedJSON(f"expected ':' at {pos}")
        pos = skip_whitespace(text, pos + 1)
        if pos >= len(text):
            node.members.append((key.text, None))
            return node
        value = _value(text, pos)
        node.members.append((key.text, value))
        if not value.complete:
            return node
        pos = skip_whitespace(text, value.end)
        if pos >= len(text):
            return node
        if text[pos] == "}":
            node.end = pos + 1
            return node
        if text[pos] != ",":
            raise MalformedJSON(f"expected ',' or '}}' at {pos}")
        pos = skip_whitespace(text, pos + 1)
    return node


def _array(text: str, start: int) -> Node:
    node = Node("array", start)
    pos = skip_whitespace(text, start + 1)
    if text.startswith("]", pos):
        node.end = pos + 1
        return node
    while pos < len(text):
        value = _value(text, pos)
        node.items.append(value)
        if not value.complete:
            return node
        pos = skip_whitespace(text, value.end)
        if pos >= len(text):
            return node
        if text[pos] == "]":
            node.end = pos + 1
            return node
        if text[pos] != ",":
            raise MalformedJSON(f"expected ',' or ']' at {pos}")
        pos = skip_whitespace(text, pos + 1)
    return node


def _string(text: str, start: int) -> Node:
    body_end = _STRING_BODY.match(text, start + 1).end()
    node = Node("string", start)
    if body_end < len(text) and text[body_end] == '"':
        node.end = body_end + 1
        node.text = json.loads(text[start:node.end])
        return node
    rest = text[body_end:]
    if rest and not _could_continue_escape(rest):
        raise MalformedJSON(f"invalid character in a string at {body_end}")
    body = text[start + 1:body_end]
    # A high surrogate whose low half has not come yet decodes to nothing yet.
    body = _HIGH_SURROGATE_ESCAPE.sub("", body)
    node.text = json.loads(f'"{body}"')
    return node


def _could_continue_escape(rest: str) -> bool:
    """Whether `rest` (what follows a string's valid run, up to the end) is the start
    of an escape sequence."""
    if rest[0] != "\\":
        return False
    if len(rest) == 1:
        return True
    return rest[1] == "u" and re.fullmatch(r"u[0-9a-fA-F]{0,3}", rest[1:]) is not None


def _scalar(text: str, pos: int) -> Node:
    for literal in _LITERALS:
        if text.startswith(literal, pos):
            return Node("literal", pos, pos + len(literal), text=literal)
        if literal.startswith(text[pos:]):
            return Node("literal", pos)  # its start, at the end of the text
    match = _NUMBER.match(text, pos)
    if match is None:
        if re.fullmatch(r"-?", text[pos:]):
            return Node("number", pos)
        raise MalformedJSON(f"unexpected character {text[pos]!r} at {pos}")
    end = match.end()
    if end == len(text) or re.fullmatch(r"-?[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]*)?",
                                        text[pos:]):
        # It may go on (more digits, a fraction, an exponent).
        return Node("number", pos)
    return Node("number", pos, end)


def render(text: str, node: Node | None) -> str:
    """The node as json.dumps(..., ensure_ascii=False) writes it, or, while it is
    unfinished, the part of that which is certain already."""
    if node is None:
        return ""
    if node.kind == "string":
        encoded = json.dumps(node.text, ensure_ascii=False)
        return encoded if node.complete else encoded[:-1]
    if node.kind in ("number", "literal"):
        if not node.complete:
            return ""
        raw = text[node.start:node.end]
        return raw if node.kind == "literal" else json.dumps(json.loads(raw))
    parts: list[str] = []
    if node.kind == "array":
        for item in node.items:
            parts.append(render(text, item))
            if not item.complete:
                break
        inner = ", ".join(parts)
        return f"[{inner}]" if node.complete else f"[{inner}"
    for key, value in node.members:
        parts.append(f"{json.dumps(key, ensure_ascii=False)}: {render(text, value)}")
        if value is None or not value.complete:
            break
    inner = ", ".join(parts)
    return f"{{{inner}}}" if node.complete else f"{{{inner}"


def member(node: Node, key: str) -> Node | None:
    """The value of `key` in an object node (the first, as json.loads keeps the
    last but a stream can only show the first); None when it has not started."""
    for name, value in node.members:
        if name == key:
            return value
    return None
