"""The pythonic format (Llama 3.2 and 4, and others prompted for it): the answer is
a Python list of calls with keyword arguments, ``[get_weather(city="Paris"),
get_time()]``; any other answer is content. Argument values are Python literals,
returned as JSON."""

from __future__ import annotations

import ast
import json
import re

from loraserve.entrypoints.tool_parsers.base import (
    IncrementalToolParser,
    ParsedCall,
    ParsedOutput,
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WHITESPACE = re.compile(r"\s*")
_CLOSING = {")": "(", "]": "[", "}": "{"}


class PythonicToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        pos = _WHITESPACE.match(text).end()
        if pos == len(text):
            return ParsedOutput(content=text if final else "")
        if text[pos] != "[":
            return ParsedOutput(content=text)
        out = ParsedOutput(well_formed=False)  # until the closing bracket
        pos += 1
        while True:
            pos = _WHITESPACE.match(text, pos).end()
            if pos == len(text):
                return out
            if text[pos] == "]" and not out.calls:
                break
            name = _NAME.match(text, pos)
            if name is None or name.end() == len(text):
                return out  # a bad start, or a name that may go on
            if text[name.end()] != "(":
                return out
            call = ParsedCall(name=name.group())
            out.calls.append(call)
            try:
                close = _matching_paren(text, name.end())
            except ValueError:
                return out
            if close is None:
                return out
            try:
                call.arguments = json.dumps(_keyword_arguments(text[pos:close + 1]),
                                            ensure_ascii=False)
            except (SyntaxError, ValueError, TypeError):
                return out
            call.complete = True
            pos = _WHITESPACE.match(text, close + 1).end()
            if pos == len(text):
                return out
            if text[pos] == "]":
                break
            if text[pos] != ",":
                return out
            pos += 1
        out.well_formed = _WHITESPACE.match(text, pos + 1).end() == len(text)
        return out


def _keyword_arguments(call_text: str) -> dict:
    """The keyword arguments of one call, as Python values."""
    call = ast.parse(call_text, mode="eval").body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
        raise ValueError("a tool call takes keyword arguments only")
    arguments = {}
    for keyword in call.keywords:
        if keyword.arg is None:
            raise ValueError("a tool call cannot unpack arguments")
        arguments[keyword.arg] = ast.literal_eval(keyword.value)
    return arguments


def _matching_paren(text: str, start: int) -> int | None:
    """The index of the bracket that closes the one at `start`, skipping strings;
    None if the text ends first. ValueError on a bracket that closes the wrong one."""
    stack: list[str] = []
    pos = start
    while pos < len(text):
        char = text[pos]
        if char in "([{":
            stack.append(char)
        elif char in _CLOSING:
            if not stack or stack.pop() != _CLOSING[char]:
                raise ValueError(f"unbalanced {char!r} at {pos}")
            if not stack:
                return pos
        elif char in "'\"":
            pos = _string_end(text, pos)
            if pos is None:
                return None
        pos += 1
    return None


def _string_end(text: str, start: int) -> int | None:
    """The index of the last character of the Python string literal at `start`."""
    quote = text[start] * 3 if text.startswith(text[start] * 3, start) else text[start]
    pos = start + len(quote)
    while pos < len(text):
        if text[pos] == "\\":
            pos += 2
            continue
        if text.startswith(quote, pos):
            return pos + len(quote) - 1
        pos += 1
    return None
