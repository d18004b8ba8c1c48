"""Tool calling's text side, without a model: each tool parser on the texts its
models write (whole, and streamed in pieces that must add up to the whole answer,
as vLLM's parser tests check), the JSON renderer streaming rests on, tool_choice's
checks and schemas, and plugin registration."""

from __future__ import annotations

import json
import random

import pytest

from loraserve.entrypoints.errors import APIError
from loraserve.entrypoints.protocol import ChatCompletionRequest
from loraserve.entrypoints.tool_calls import (
    NamedToolCall,
    RequiredToolCalls,
    resolve_tool_choice,
    template_message,
    tool_constraint,
)
from loraserve.entrypoints.tool_parsers import ToolParser, ToolParserManager
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse, render

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                 **fields)


def _calls(extracted) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls]


# (parser, model text, content, [(name, arguments)]): the calls as the model meant them.
CASES = [
    ("hermes",
     'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "days": [1, 2.50], "metric": true, "note": null}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris \\"CET\\" é\\u00e9"}}'
     "\n</tool_call>",
     "Let me look that up.\n",
     [("get_weather", {"city": "Paris", "days": [1, 2.5], "metric": True, "note": None}),
      ("get_time", {"tz": 'Europe/Paris "CET" éé'})]),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', None,
     [("get_time", {})]),
    ("llama3_json",
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "arguments": {"tz": "UTC", "offset": -1e2}}',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "offset": -100.0})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome 😀"}}', None,
     [("get_weather", {"city": "Rome 😀"})]),
    ("mistral",
     'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "n": 3}}, '
     '{"name": "get_time", "arguments": {}}]',
     "Sure.", [("get_weather", {"city": "Paris", "n": 3}), ("get_time", {})]),
    ("pythonic",
     '[get_weather(city="Paris", days=[1, -2], opts={"a": None, "b": True}), '
     "get_time(tz='a)b]c')]",
     None, [("get_weather", {"city": "Paris", "days": [1, -2], "opts": {"a": None, "b": True}}),
            ("get_time", {"tz": "a)b]c"})]),
    ("pythonic", "[get_time()]", None, [("get_time", {})]),
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_parsers_find_the_calls_in_a_whole_answer(name, text, content, calls):
    parser = ToolParserManager.get_tool_parser(name)(None)
    found = parser.extract_tool_calls(text, _request())
    assert found.tools_called
    assert found.content == content
    assert _calls(found) == calls
    for call in found.tool_calls:
        # OpenAI's form: JSON text as json.dumps writes it.
        assert call.function.arguments == json.dumps(json.loads(call.function.arguments),
                                                     ensure_ascii=False)
        assert call.type == "function"
    ids = [call.id for call in found.tool_calls]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(len(i) == 9 and i.isalnum() for i in ids)
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids)


def _stream(parser: ToolParser, text: str, pieces: list[str]) -> tuple[str, list]:
    """Feed the pieces as a stream; the content and the (name, arguments) of each
    call, put back together from the deltas."""
    request = _request()
    content, calls = "", {}
    previous = ""
    deltas = []
    for piece in pieces:
        current = previous + piece
        deltas.append(parser.extract_tool_calls_streaming(
            previous, current, piece, [], [], [], request))
        previous = current
    assert previous == text
    deltas.append(parser.finish_streaming(text, request))
    for delta in deltas:
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                # The first delta of a call carries its id, type and name.
                assert call.id and call.type == "function" and call.function.name
                calls[call.index] = [call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][1] += call.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[i]) for i in sorted(calls)]


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    if seed == 0:
        return list(text)  # one character at a time
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
def test_streamed_deltas_add_up_to_the_whole_answer(name, text, content, calls):
    cls = ToolParserManager.get_tool_parser(name)
    whole = cls(None).extract_tool_calls(text, _request())
    want = (whole.content or "",
            [(c.function.name, c.function.arguments) for c in whole.tool_calls])
    for seed in range(8):
        assert _stream(cls(None), text, _pieces(text, seed)) == want, seed


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "pythonic"])
@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "",
    "   ",
    "Use <tool_ and [TOOL_ and <|python_ as plain words",
])
def test_plain_answers_are_content(name, text):
    cls = ToolParserManager.get_tool_parser(name)
    found = cls(None).extract_tool_calls(text, _request())
    assert not found.tools_called and found.content == text
    assert _stream(cls(None), text, list(text)) == (text, []) if text else True


@pytest.mark.parametrize(("name", "text", "content"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>', None),
    ("hermes", '<tool_call>{"name": "f"}</tool_call>', None),  # no arguments
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}} trailing words', None),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}', "[{\"name\": \"f\", "
                '"arguments": {"a": 1}'),
    ("pythonic", "[f(1, 2)]", None),  # positional arguments
    ("pythonic", "[f(a=1)] and more", None),
])
def test_calls_that_do_not_parse_are_content(name, text, content):
    found = ToolParserManager.get_tool_parser(name)(None).extract_tool_calls(text, _request())
    assert not found.tools_called and not found.tool_calls
    assert found.content == (text if content is None else content)


def test_streaming_holds_back_a_marker_that_may_be_starting():
    parser = ToolParserManager.get_tool_parser("hermes")(None)
    request = _request()
    first = parser.extract_tool_calls_streaming("", "Hi <tool", "Hi <tool", [], [], [], request)
    assert first.content == "Hi "  # "<tool" may open a call
    second = parser.extract_tool_calls_streaming("Hi <tool", "Hi <tools!", "s!", [], [], [],
                                                 request)
    assert second.content == "<tools!"


def test_hermes_and_mistral_keep_special_tokens_in_the_text():
    for name in ("hermes", "mistral"):
        request = _request()
        assert request.skip_special_tokens
        ToolParserManager.get_tool_parser(name)(None).adjust_request(request)
        assert not request.skip_special_tokens


# ---- the JSON renderer ------------------------------------------------------------


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, -3e-2, True, None], "b": {"c": "x\ny\"z\\ é 😀"}, "": {}},
    [[], {}, "", 0, -0.0, 1e300, "\u0001"],
    {"nested": {"deeper": [{"k": "v"}, [1, [2, [3]]]]}},
])
@pytest.mark.parametrize("indent", [None, 2])
def test_render_of_every_prefix_is_a_prefix_of_the_whole(value, indent):
    raw = json.dumps(value, indent=indent, ensure_ascii=indent is None)
    whole = render(raw, parse(raw))
    assert whole == json.dumps(json.loads(raw), ensure_ascii=False)
    for end in range(len(raw) + 1):
        node = parse(raw[:end])
        part = render(raw[:end], node)
        assert whole.startswith(part), (raw[:end], part)


@pytest.mark.parametrize("bad", ['{"a" 1}', '{"a": 1 "b": 2}', "[1 2]", '{"a": tru3}',
                                 '"\\x"', "{a: 1}", "@"])
def test_render_refuses_text_that_is_not_json(bad):
    with pytest.raises(MalformedJSON):
        parse(bad)


# ---- tool_choice -----------------------------------------------------------------


@pytest.mark.parametrize(("fields", "auto", "mode"), [
    ({}, True, "auto"),
    ({"tool_choice": "none"}, False, "none"),
    ({"tool_choice": "required"}, False, "required"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, False, "named"),
    ({"tool_choice": None}, False, "none"),
    ({"tool_choice": None}, True, "auto"),
])
def test_tool_choice_resolves_as_vllm_reads_it(fields, auto, mode):
    assert resolve_tool_choice(_request(**fields), auto).mode == mode


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({}, "tool_choice", '"auto" tool choice requires --enable-auto-tool-choice'),
    ({"tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": "always"}, "tool_choice", "Invalid value for `tool_choice`"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "does not match any of the specified `tools`"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function", "Correct usage"),
    ({"tool_choice": {"function": {}}}, "tool_choice.function.name", "Expected field `name`"),
])
def test_bad_tool_choices_are_400(fields, param, words):
    with pytest.raises(APIError) as info:
        resolve_tool_choice(_request(**fields), auto_enabled=False)
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message


@pytest.mark.parametrize(("tools", "words"), [
    ([], "must not be an empty array"),
    ([{"type": "function", "function": {"description": "no name"}}], "name"),
    ([{"type": "retrieval"}], "tools[0]"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "parameters"),
])
def test_bad_tools_are_400(tools, words):
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice="required")
    with pytest.raises(APIError) as info:
        resolve_tool_choice(request, auto_enabled=True)
    assert info.value.param == "tools" and words in info.value.message


def test_tool_choice_without_tools_is_400():
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                    tool_choice="required")
    with pytest.raises(APIError, match="`tools` must be set"):
        resolve_tool_choice(request, auto_enabled=True)


def test_required_and_named_schemas_are_vllms():
    jsonschema = pytest.importorskip("jsonschema")
    request = _request(tool_choice="required")
    constraint = tool_constraint(request, resolve_tool_choice(request, False))
    schema = json.loads(constraint.params.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    valid = [{"name": "get_weather", "parameters": {"city": "Paris"}},
             {"name": "get_time", "parameters": {}}]
    jsonschema.validate(valid, schema)
    for wrong in ([], [{"name": "nope", "parameters": {}}],
                  [{"name": "get_weather", "parameters": {}}], [{"name": "get_time"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    single = _request(tool_choice="required", parallel_tool_calls=False)
    assert json.loads(tool_constraint(single, resolve_tool_choice(single, False))
                      .params.json)["maxItems"] == 1
    named = _request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(tool_constraint(named, resolve_tool_choice(named, False)).params.json) \
        == TOOLS[0]["function"]["parameters"]
    bare = _request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(tool_constraint(bare, resolve_tool_choice(bare, False)).params.json) \
        == {"type": "object", "properties": {}}


def test_required_schema_gathers_defs_and_refuses_conflicting_ones():
    defs = {"$defs": {"Unit": {"enum": ["C", "F"]}}, "type": "object",
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": defs}},
             {"type": "function", "function": {"name": "b", "parameters": defs}}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools,
                                    tool_choice="required")
    schema = json.loads(tool_constraint(request, resolve_tool_choice(request, False))
                        .params.json)
    assert schema["$defs"] == {"Unit": {"enum": ["C", "F"]}}
    assert "$defs" in tools[0]["function"]["parameters"]  # the request is left as it was
    other = {**defs, "$defs": {"Unit": {"enum": ["K"]}}}
    tools[1]["function"]["parameters"] = other
    with pytest.raises(APIError, match="multiple schemas"):
        tool_constraint(request, resolve_tool_choice(request, False))


def test_required_and_named_answers_stream_as_they_parse():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, ' \
           '{"name": "get_time", "parameters": {}}]'
    whole = RequiredToolCalls(None).extract_tool_calls(text, _request())
    assert _calls(whole) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    want = ("", [(c.function.name, c.function.arguments) for c in whole.tool_calls])
    for seed in range(6):
        assert _stream(RequiredToolCalls(None), text, _pieces(text, seed)) == want
    cut = RequiredToolCalls(None).extract_tool_calls(text[:30], _request())
    assert not cut.tools_called and cut.content == text[:30]
    named = '{"city":  "Paris"}'
    found = NamedToolCall(None, "get_weather").extract_tool_calls(named, _request())
    # As vLLM: a named function's arguments are the answer's text as it is.
    assert [(c.function.name, c.function.arguments) for c in found.tool_calls] == \
        [("get_weather", named)]
    assert _stream(NamedToolCall(None, "get_weather"), named, list(named)) == \
        ("", [("get_weather", named)])


def test_assistant_tool_calls_reach_the_template_with_object_arguments():
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}},
    ]}
    converted = template_message(message, 1)
    assert [c["function"]["arguments"] for c in converted["tool_calls"]] == [
        {"city": "Paris"}, {}]
    assert message["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    with pytest.raises(APIError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        template_message({"role": "assistant", "tool_calls": [
            {"function": {"name": "f", "arguments": "{not json"}}]}, 1)
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert template_message(tool, 2) == tool


def test_a_plugin_file_registers_a_parser(tmp_path):
    plugin = tmp_path / "shout_parser.py"
    plugin.write_text(
        "from loraserve.entrypoints.protocol import ExtractedToolCallInformation\n"
        "from loraserve.entrypoints.tool_parsers import ToolParser, ToolParserManager\n"
        "\n"
        "@ToolParserManager.register_module(['shout', 'shout2'])\n"
        "class ShoutParser(ToolParser):\n"
        "    def extract_tool_calls(self, model_output, request):\n"
        "        return ExtractedToolCallInformation(tools_called=False,\n"
        "                                            content=model_output.upper())\n"
    )
    with pytest.raises(KeyError, match="known: .*hermes"):
        ToolParserManager.get_tool_parser("shout")
    ToolParserManager.import_tool_parser(str(plugin))
    try:
        for name in ("shout", "shout2"):
            parser = ToolParserManager.get_tool_parser(name)(None)
            assert parser.extract_tool_calls("hi", _request()).content == "HI"
    finally:
        for name in ("shout", "shout2"):
            ToolParserManager.tool_parsers.pop(name, None)
    with pytest.raises(ValueError, match="is not a file"):
        ToolParserManager.import_tool_parser(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken_parser.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="failed to load: RuntimeError: boom"):
        ToolParserManager.import_tool_parser(str(broken))
