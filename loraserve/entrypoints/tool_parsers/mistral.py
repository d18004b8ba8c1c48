"""Mistral's format: content, then ``[TOOL_CALLS]`` and a JSON list of calls
``[{"name": ..., "arguments": {...}}, ...]``. Call ids are Mistral's: 9 letters
and digits."""

from __future__ import annotations

from loraserve.entrypoints.protocol import ChatCompletionRequest, mistral_tool_call_id
from loraserve.entrypoints.tool_parsers.base import (
    IncrementalToolParser,
    ParsedOutput,
    held_back,
)
from loraserve.entrypoints.tool_parsers.json_calls import json_call
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse

TOOL_CALLS = "[TOOL_CALLS]"


class MistralToolParser(IncrementalToolParser):
    make_call_id = staticmethod(mistral_tool_call_id)

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        # [TOOL_CALLS] is a special token in Mistral's tokenizers: keep it in the text.
        if request.tools and request.tool_choice != "none":
            request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedOutput:
        at = text.find(TOOL_CALLS)
        if at < 0:
            keep = 0 if final else held_back(text, TOOL_CALLS)
            return ParsedOutput(content=text[:len(text) - keep])
        out = ParsedOutput(content=text[:at])
        try:
            node = parse(text, at + len(TOOL_CALLS))
        except MalformedJSON:
            out.well_formed = False
            return out
        if node is None:
            return out
        if node.kind != "array":
            out.well_formed = False
            return out
        for item in node.items:
            if item.kind != "object":
                out.well_formed = False
                break
            out.calls.append(json_call(text, item))
        return out

    def unparsed_content(self, model_output: str) -> str:
        return model_output.replace(TOOL_CALLS, "").strip()
