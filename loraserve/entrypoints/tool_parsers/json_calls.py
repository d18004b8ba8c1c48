"""Tool calls written as JSON objects, {"name": ..., "arguments": {...}}, as the
hermes, llama3_json and mistral formats (and tool_choice "required") write them."""

from __future__ import annotations

from loraserve.entrypoints.tool_parsers.base import ParsedCall
from loraserve.entrypoints.tool_parsers.partial_json import Node, member, render


def json_call(text: str, node: Node, argument_keys: tuple[str, ...] = ("arguments",)) -> ParsedCall:
    """The call an object node holds: its name once the name string is whole, its
    arguments (the first of `argument_keys` present) rendered as far as they go."""
    name = member(node, "name")
    arguments = next((value for key in argument_keys
                      if (value := member(node, key)) is not None), None)
    return ParsedCall(
        name=name.text if name is not None and name.kind == "string" and name.complete
        else None,
        arguments=render(text, arguments),
        complete=node.complete and arguments is not None and arguments.complete,
    )
