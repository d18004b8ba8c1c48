"""Tool-call parsers for `tool_choice: "auto"` (--enable-auto-tool-choice
--tool-call-parser NAME): hermes, llama3_json, mistral, pythonic, and any that a
--tool-parser-plugin file registers (see base.py for the contract)."""

from loraserve.entrypoints.tool_parsers.base import (
    IncrementalToolParser,
    ParsedCall,
    ParsedOutput,
    ToolParser,
    ToolParserManager,
)

__all__ = ["IncrementalToolParser", "ParsedCall", "ParsedOutput", "ToolParser",
           "ToolParserManager"]
