"""Chat tool calling as vLLM does it.

`tool_choice` "none" leaves the answer as text; "required" and a named function
constrain the answer with a JSON schema built from the tools (structured outputs,
so any model answers with valid calls): "required" to a list of
``{"name": ..., "parameters": {...}}``, a named function to its parameters; "auto"
lets the model choose and reads its calls with the server's tool parser
(--enable-auto-tool-choice --tool-call-parser NAME). All of them read the answer
through a ToolParser, whole or as it streams.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from loraserve.entrypoints.errors import bad_request
from loraserve.entrypoints.protocol import ChatCompletionRequest
from loraserve.entrypoints.structured_outputs import Constraint
from loraserve.entrypoints.tool_parsers.base import (
    IncrementalToolParser,
    ParsedCall,
    ParsedOutput,
    ToolParser,
)
from loraserve.entrypoints.tool_parsers.json_calls import json_call
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse, skip_whitespace
from loraserve.structured_output.params import StructuredOutputsParams

_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# The parameters of a function that declares none: an empty object.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none, auto, required or named
    function: str | None = None  # the named function

    @property
    def constrained(self) -> bool:
        """The answer is constrained to tool calls (required or named)."""
        return self.mode in ("required", "named")


def resolve_tool_choice(request: ChatCompletionRequest, auto_enabled: bool) -> ToolChoice:
    """The request's tool choice, checked as vLLM checks it (400s with its words).
    `auto_enabled`: the server has --enable-auto-tool-choice and a parser."""
    tools = request.tools
    if tools is not None:
        if not tools:
            raise bad_request("`tools` must not be an empty array. Either provide at least "
                              "one tool or omit the field entirely.", param="tools")
        _check_tools(tools)
    choice = request.tool_choice
    if "tool_choice" not in request.model_fields_set:
        choice = "auto" if tools else "none"
    elif choice is None:
        # An explicit null: vLLM parses calls when it can and answers text otherwise.
        choice = "auto" if tools and auto_enabled else "none"
    if choice == "none":
        return ToolChoice("none")
    if not tools:
        raise bad_request("When using `tool_choice`, `tools` must be set.", param="tool_choice")
    if isinstance(choice, dict):
        return ToolChoice("named", _named_function(choice, tools))
    if choice not in ("auto", "required"):
        raise bad_request(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                          '"none", "auto" or "required" are supported.', param="tool_choice")
    if choice == "auto" and not auto_enabled:
        raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and '
                          "--tool-call-parser to be set", param="tool_choice")
    return ToolChoice(choice)


def _check_tools(tools: list[Any]) -> None:
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(function, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.',
                              param="tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string.",
                              param="tools")
        if function.get("parameters") is not None and not isinstance(function["parameters"],
                                                                     dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.",
                              param="tools")


def _named_function(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                          f"{_NAMED_USAGE}", param="tool_choice.function")
    if "name" not in function:
        raise bad_request(f"Expected field `name` in `function` in `tool_choice`! "
                          f"{_NAMED_USAGE}", param="tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise bad_request(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                          f"{_NAMED_USAGE}", param="tool_choice.function.name")
    if not any(tool["function"]["name"] == name for tool in tools):
        raise bad_request("The tool specified in `tool_choice` does not match any of the "
                          "specified `tools`", param="tool_choice")
    return name


def tool_constraint(request: ChatCompletionRequest, choice: ToolChoice) -> Constraint | None:
    """The JSON schema the answer must follow for "required" or a named function."""
    if not choice.constrained:
        return None
    tools = {tool["function"]["name"]: tool["function"] for tool in request.tools}
    if choice.mode == "named":
        schema = tools[choice.function].get("parameters") or _NO_PARAMETERS
    else:
        schema = _required_schema(list(tools.values()), request.parallel_tool_calls is False)
    return Constraint(StructuredOutputsParams(json=schema), "tools")


def _required_schema(functions: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """A list of one or more calls, each {"name": one of the functions, "parameters":
    that function's parameters}, with the parameters' $defs gathered at the top."""
    branches = []
    defs: dict[str, Any] = {}
    for function in functions:
        parameters = copy.deepcopy(function.get("parameters") or _NO_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(f"Tool definition '{name}' has multiple schemas, which is not "
                                  "supported.", param="tools")
            defs[name] = schema
        branches.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": branches}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolCall(IncrementalToolParser):
    """tool_choice names a function: the whole answer is its arguments."""

    def __init__(self, tokenizer: Any, function: str) -> None:
        super().__init__(tokenizer)
        self.function = function

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(calls=[ParsedCall(self.function, text, complete=final)])


class RequiredToolCalls(IncrementalToolParser):
    """tool_choice "required": the answer is a JSON list of calls
    [{"name": ..., "parameters": {...}}, ...]."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        out = ParsedOutput()
        try:
            node = parse(text)
        except MalformedJSON:
            out.well_formed = False
            return out
        if node is None:
            return out
        if node.kind != "array" or not all(item.kind == "object" for item in node.items):
            out.well_formed = False
            return out
        out.calls = [json_call(text, item, ("parameters",)) for item in node.items]
        out.well_formed = node.complete and skip_whitespace(text, node.end) == len(text)
        return out


def answer_parser(choice: ToolChoice, parser_class: type[ToolParser] | None,
                  tokenizer: Any) -> ToolParser | None:
    """What reads one answer's tool calls (None: the answer is plain text)."""
    if choice.mode == "named":
        return NamedToolCall(tokenizer, choice.function)
    if choice.mode == "required":
        return RequiredToolCalls(tokenizer)
    if choice.mode == "auto" and parser_class is not None:
        return parser_class(tokenizer)
    return None


def finish_reason(choice: ToolChoice, called: bool, engine_reason: str | None,
                  streamed: bool = False) -> str | None:
    """vLLM's finish reason: "tool_calls" when calls were made for "auto" (streamed:
    only when the answer ended by itself), or for "required" when the answer ended by
    itself; a named call keeps the engine's ("stop", as OpenAI's)."""
    if engine_reason is None or not called:
        return engine_reason
    if choice.mode == "auto" and (engine_reason == "stop" or not streamed):
        return "tool_calls"
    if choice.mode == "required" and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def template_message(data: dict[str, Any], index: int) -> dict[str, Any]:
    """An assistant message's tool calls as chat templates take them: arguments as
    objects, not JSON text (as vLLM hands them to templates)."""
    calls = data.get("tool_calls")
    if data.get("role") != "assistant" or calls is None:
        return data
    if not isinstance(calls, list):
        raise bad_request(f"messages[{index}].tool_calls must be a list.",
                          param=f"messages.[{index}].tool_calls")
    converted = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise bad_request(f"messages[{index}].tool_calls[{j}].function must be an object.",
                              param=f"messages.[{index}].tool_calls")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise bad_request(f"messages[{index}].tool_calls[{j}].function.arguments is not "
                                  f"valid JSON: {exc}", param=f"messages.[{index}].tool_calls"
                                  ) from exc
        elif not arguments:
            arguments = {}
        converted.append({**call, "function": {**function, "arguments": arguments}})
    return {**data, "tool_calls": converted}
