"""Hermes' format (Hermes 2 Pro and 3, Qwen 2.5 and 3 and their fine-tunes): content,
then calls as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

from loraserve.entrypoints.protocol import ChatCompletionRequest
from loraserve.entrypoints.tool_parsers.base import (
    IncrementalToolParser,
    ParsedOutput,
    held_back,
)
from loraserve.entrypoints.tool_parsers.json_calls import json_call
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse, skip_whitespace

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(IncrementalToolParser):
    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        # The tags are special tokens in these models' tokenizers: keep them in the text.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(START)
        if at < 0:
            keep = 0 if final else held_back(text, START)
            return ParsedOutput(content=text[:len(text) - keep])
        out = ParsedOutput(content=text[:at])
        while at >= 0:
            body_start = at + len(START)
            end = text.find(END, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            closed = end >= 0
            try:
                node = parse(body)
            except MalformedJSON:
                out.well_formed = False
                break
            if node is None or node.kind != "object":
                # Nothing yet is fine while the call is open.
                out.well_formed = node is None and not closed
                break
            out.calls.append(json_call(body, node))
            if not closed:
                break
            if not node.complete or skip_whitespace(body, node.end) != len(body):
                out.well_formed = False
                break
            at = text.find(START, end + len(END))
        return out
