"""Llama 3.1-3.3's JSON format: the answer is one or more calls
``{"name": ..., "parameters": {...}}`` ("arguments" too), separated by ``;`` and
maybe led by ``<|python_tag|>``; any other answer is content."""

from __future__ import annotations

from loraserve.entrypoints.tool_parsers.base import IncrementalToolParser, ParsedOutput
from loraserve.entrypoints.tool_parsers.json_calls import json_call
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(IncrementalToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        if not start and not final and PYTHON_TAG.startswith(text):
            return ParsedOutput()  # maybe the tag: wait for more
        pos = skip_whitespace(text, start)
        if pos == len(text):
            # Whitespace so far: a call or content, the next text tells.
            return ParsedOutput(content=text if final else "")
        if text[pos] != "{":
            return ParsedOutput(content=text)
        out = ParsedOutput()
        while True:
            try:
                node = parse(text, pos)
            except MalformedJSON:
                out.well_formed = False
                break
            if node is None:
                break
            if node.kind != "object":
                out.well_formed = False
                break
            out.calls.append(json_call(text, node, ("arguments", "parameters")))
            if not node.complete:
                break
            pos = skip_whitespace(text, node.end)
            if pos == len(text):
                break
            if text[pos] != ";":
                out.well_formed = False
                break
            pos += 1
        return out
