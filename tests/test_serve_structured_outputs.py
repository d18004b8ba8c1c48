"""`loraserve serve` with structured outputs and tool calling, end to end on the
CPU: every request field vLLM takes for them, on completions and chat, streamed and
not, for the base model and adapters at once; 400s that name the problem; tool
calls for tool_choice "required", a named function and "auto" (the hermes parser);
tool messages through the chat template."""

from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_utils import ServerProcess

from loraserve.cli_args import build_parser, validate_serve_args

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" [a-c] ("," [a-c]){0,2} ")"'
GRAMMAR_LANGUAGE = r"\([a-c](?:,[a-c]){0,2}\)"
WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]
MODELS = ["base", "r8", "r16"]
# Shows what a tool-calling template sees: the tools, calls with object arguments,
# and tool results.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}\n{% endfor %}"
    "{% if m.role == 'tool' %}RESULT {{ m.tool_call_id }} {% endif %}"
    "{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if tools %}TOOLS {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TEMPLATE)
    with ServerProcess([
        llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", f"r8={llama_adapters['r8']}",
        f"r16={llama_adapters['r16_qv']}", "--chat-template", str(template),
        # A random model would write whitespace between JSON tokens for ever.
        "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
    ]) as srv:
        yield srv


# ---- the flags ------------------------------------------------------------------


def _parsed(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", "m", *argv])
    validate_serve_args(args)
    return args


def test_vllms_structured_output_flags_name_xgrammar():
    assert _parsed().engine_args.structured_outputs_config.backend == "auto"
    config = _parsed("--structured-outputs-config",
                     '{"backend": "xgrammar", "disable_any_whitespace": true, '
                     '"disable_fallback": true}').engine_args.structured_outputs_config
    assert config.backend == "xgrammar" and config.disable_any_whitespace
    config = _parsed("--guided-decoding-backend",
                     "xgrammar:disable-any-whitespace").engine_args.structured_outputs_config
    assert config.backend == "xgrammar" and config.disable_any_whitespace


@pytest.mark.parametrize(("argv", "message"), [
    (["--structured-outputs-config", '{"backend": "guidance"}'],
     "--structured-outputs-config: backend 'guidance' is not supported; .* xgrammar"),
    (["--structured-outputs-config", '{"backend": "xgrammar", "colour": 1}'], "unknown keys"),
    (["--structured-outputs-config", "xgrammar"], "must be a JSON object"),
    (["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'],
     "no reasoning parsers"),
    (["--guided-decoding-backend", "outlines"],
     "--guided-decoding-backend 'outlines' is not supported"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
     "--tool-call-parser: tool parser 'nope' is not registered; known: hermes, llama3_json, "
     "mistral, pythonic"),
    (["--tool-parser-plugin", "/no/such/plugin.py"], "--tool-parser-plugin: .* is not a file"),
])
def test_bad_structured_output_and_tool_flags_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _parsed(*argv)


def test_the_two_backend_flags_are_one_choice(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--guided-decoding-backend", "xgrammar",
                                   "--structured-outputs-config", "{}"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_tool_parser_plugin_is_loaded_at_start(tmp_path):
    from loraserve.entrypoints.tool_parsers import ToolParserManager

    plugin = tmp_path / "echo_parser.py"
    plugin.write_text("from loraserve.entrypoints.tool_parsers import ToolParser, "
                      "ToolParserManager\n\n\n"
                      "@ToolParserManager.register_module('echo')\n"
                      "class EchoParser(ToolParser):\n    pass\n")
    try:
        args = _parsed("--enable-auto-tool-choice", "--tool-parser-plugin", str(plugin),
                       "--tool-call-parser", "echo")
        assert args.server_args.tool_call_parser == "echo"
        assert ToolParserManager.get_tool_parser("echo").__name__ == "EchoParser"
    finally:
        ToolParserManager.tool_parsers.pop("echo", None)


# ---- the server ------------------------------------------------------------------


def _post(server, path: str, body: dict) -> dict:
    response = server.post(path, body)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(server, path: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", server.url + path, json={**body, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    assert chunks and "error" not in chunks[-1], chunks[-1:]
    return chunks


def _answer(server, endpoint: str, body: dict, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of a completion or chat answer, streamed or not."""
    path = f"/v1/{endpoint}"
    if not stream:
        choice = _post(server, path, body)["choices"][0]
        text = choice["text"] if endpoint == "completions" else choice["message"]["content"]
        return text, choice["finish_reason"]
    text, finish = "", None
    for chunk in _stream(server, path, body):
        for choice in chunk["choices"]:
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return text, finish


def _json_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# field(s) -> does a whole answer satisfy them
FIELDS = [
    ({"guided_json": SCHEMA}, _json_valid),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                                 "strict": True}}},
     _json_valid),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, _json_valid),
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
    ({"guided_grammar": GRAMMAR}, lambda t: re.fullmatch(GRAMMAR_LANGUAGE, t) is not None),
    ({"structured_outputs": {"grammar": GRAMMAR}},
     lambda t: re.fullmatch(GRAMMAR_LANGUAGE, t) is not None),
]


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_hold_for_the_base_model_and_adapters_at_once(server, endpoint, stream):
    def body(fields: dict, model: str) -> dict:
        prompt = {"prompt": "The quick brown fox"} if endpoint == "completions" else \
            {"messages": [{"role": "user", "content": "Tell me about yourself"}]}
        return {"model": model, "max_tokens": 48, "temperature": 0, **prompt, **fields}

    jobs = [(fields, holds, model) for fields, holds in FIELDS for model in MODELS]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one batch, as far as timing allows
        answers = list(pool.map(lambda job: _answer(server, endpoint, body(job[0], job[2]),
                                                    stream), jobs))
    for (fields, holds, model), (text, finish) in zip(jobs, answers, strict=True):
        assert finish == "stop" and holds(text), (fields, model, text)
    # Unconstrained, the model's junk satisfies none of them.
    plain = [_answer(server, endpoint, body({}, model), stream)[0] for model in MODELS]
    for _, holds in FIELDS:
        assert not any(holds(text) for text in plain), plain


def test_json_object_answers_parse(server):
    body = {"model": "base", "prompt": "Hello world!", "max_tokens": 48, "temperature": 0,
            "response_format": {"type": "json_object"}}
    text, finish = _answer(server, "completions", body, stream=False)
    assert finish == "stop" and isinstance(json.loads(text), dict), text


def test_streamed_and_whole_answers_agree(server):
    body = {"model": "r8", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48,
            "temperature": 0, "guided_json": SCHEMA}
    assert _answer(server, "chat/completions", body, stream=True) == \
        _answer(server, "chat/completions", body, stream=False)


def test_plain_requests_beside_constrained_ones_get_their_own_tokens(server):
    plain = {"model": "r16", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0,
             "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    alone = _post(server, "/v1/completions", plain)["choices"][0]["logprobs"]["tokens"]
    constrained = [{"model": model, "prompt": "Once upon a time", "max_tokens": 24,
                    "temperature": 0, **fields} for fields, _ in FIELDS for model in MODELS]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_post, server, "/v1/completions", body) for body in constrained]
        beside = pool.submit(_post, server, "/v1/completions", plain).result()
        for future in futures:
            future.result()
    assert beside["choices"][0]["logprobs"]["tokens"] == alone


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"guided_json": {"type": "bogus"}}, "guided_json", 'Unsupported type "bogus"'),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "'uniqueItems'"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "not valid JSON"),
    ({"guided_regex": "[a-"}, "guided_regex", "Invalid regex"),
    ({"guided_grammar": 'root ::= "a" | b'}, "guided_grammar", 'Rule "b" is not defined'),
    ({"guided_choice": []}, "guided_choice", "must not be an empty list"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "'json_schema' field must be provided"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "only use one kind"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown fields ['regexp']"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs",
     "none is specified"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structural_tag is not supported"),
    ({"structural_tag": "{}"}, "structural_tag", "structural_tag is not supported"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "backend selection is not supported"),
])
def test_constraints_the_engine_cannot_compile_are_400(server, fields, param, words):
    response = server.post("/v1/completions", {"model": "base", "prompt": "hi",
                                               "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("backend", ["xgrammar", "auto", "xgrammar:disable-any-whitespace"])
def test_the_servers_backend_may_be_named(server, backend):
    body = {"model": "base", "prompt": "hi", "max_tokens": 16, "temperature": 0,
            "guided_regex": REGEX, "guided_decoding_backend": backend,
            "guided_whitespace_pattern": r"[ ]?"}
    text, finish = _answer(server, "completions", body, stream=False)
    assert finish == "stop" and re.fullmatch(REGEX, text)


# ---- tool calling ----------------------------------------------------------------


def _chat(model: str = "base", **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "What's the weather?"}],
            "max_tokens": 64, "temperature": 0, "tools": TOOLS, **fields}


def _check_call(call: dict) -> tuple[str, dict]:
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER if name == "get_weather" else
                        {"type": "object", "properties": {}, "additionalProperties": False})
    return name, arguments


def _streamed_calls(server, body: dict) -> tuple[str | None, list[tuple[str, dict]], str]:
    """(content, [(name, arguments)], finish_reason) put back together from a stream."""
    content, calls, finish = "", {}, None
    for chunk in _stream(server, "/v1/chat/completions", body):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                if call["index"] not in calls:
                    assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
                    calls[call["index"]] = [call["function"]["name"], ""]
                calls[call["index"]][1] += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    return content, [(name, json.loads(args)) for name, args in calls.values()], finish


@pytest.mark.parametrize("model", MODELS)
def test_required_tool_choice_gives_valid_tool_calls(server, model):
    body = _chat(model, tool_choice="required", parallel_tool_calls=False)
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert message["content"] == "" and len(message["tool_calls"]) == 1
    calls = [_check_call(call) for call in message["tool_calls"]]
    assert _streamed_calls(server, body) == ("", calls, "tool_calls")


def test_required_tool_choice_may_call_several_tools(server):
    choice = _post(server, "/v1/chat/completions",
                   _chat("r8", tool_choice="required", max_tokens=160))["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        assert [_check_call(call) for call in choice["message"]["tool_calls"]]
    else:  # cut by max_tokens: no calls, and the text is a start of the list
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"].startswith('[{"name": "')


@pytest.mark.parametrize("model", MODELS)
def test_a_named_tool_choice_calls_that_tool(server, model):
    body = _chat(model, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    # As OpenAI's: a named call keeps finish_reason "stop".
    assert choice["finish_reason"] == "stop"
    (call,) = choice["message"]["tool_calls"]
    name, arguments = _check_call(call)
    assert name == "get_weather"
    assert _streamed_calls(server, body) == ("", [(name, arguments)], "stop")


def test_auto_tool_choice_reads_the_models_hermes_calls(server):
    # The tiny model writes no tool calls of its own: a regex makes it write one.
    forced = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": '
              r'\{"city": "(Paris|Rome)", "days": [1-9]\}\}</tool_call>')
    body = _chat("r16", guided_regex=forced, max_tokens=160)
    choice = _post(server, "/v1/chat/completions", body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] == "Checking."
    (call,) = choice["message"]["tool_calls"]
    name, arguments = _check_call(call)
    assert name == "get_weather"
    assert _streamed_calls(server, body) == ("Checking.", [(name, arguments)], "tool_calls")
    # Text without calls stays text.
    plain = _post(server, "/v1/chat/completions", _chat("r16", max_tokens=8))["choices"][0]
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"
    assert plain["message"]["content"]


def test_tool_choice_and_another_constraint_are_400(server):
    response = server.post("/v1/chat/completions", _chat(tool_choice="required",
                                                         guided_regex="a"))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tool_choice" and "guided_regex is set beside" in error["message"]


def test_tool_calls_and_results_reach_the_chat_template(server):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    ids = _post(server, "/tokenize", {"model": "base", "messages": messages})["tokens"]
    text = _post(server, "/detokenize", {"model": "base", "tokens": ids})["prompt"]
    assert "CALL get_weather Paris\n" in text and "RESULT call_1 sunny" in text
    # tool_choice "none" still shows the tools to the template, as vLLM does.
    with_tools = _post(server, "/v1/chat/completions", {**_chat(tool_choice="none"),
                                                        "max_tokens": 1})
    without = _post(server, "/v1/chat/completions", {**_chat(), "max_tokens": 1,
                                                     "tools": None})
    assert with_tools["usage"]["prompt_tokens"] > without["usage"]["prompt_tokens"]
    bad = server.post("/v1/chat/completions", {**_chat(tool_choice="none"), "messages": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]})
    assert bad.status_code == 400 and "arguments is not valid JSON" in bad.text
