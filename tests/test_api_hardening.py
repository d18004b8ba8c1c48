"""The API server against careless and hostile clients: every bad request is a 4xx
in OpenAI's error shape that names what is wrong, large or slow requests do not
stall anyone else, the API key guards everything but the probes, and the process
shuts down (SIGTERM) or dies (SIGKILL) without cutting answers short or leaving
files behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServerProcess, alive, unix_socket_paths, wait_until

from loraserve.entrypoints.core_client import IPC_DIR_PREFIX, remove_stale_ipc_dirs
from loraserve.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from loraserve.entrypoints.request_tokenizer import RequestTokenizer
from loraserve.entrypoints.serving_chat import OpenAIServingChat
from loraserve.entrypoints.serving_common import ModelLimits
from loraserve.entrypoints.serving_completion import OpenAIServingCompletion

API_KEY = "hardening-key"
VOCAB = 384  # the tiny test model's vocab_size (tests/utils.py)
SMALL_BODY_LIMIT = 200_000
HELLO = {"model": "base", "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": "base", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
LONG = {"model": "base", "prompt": "Once upon a time", "max_tokens": 450, "temperature": 0.0,
        "ignore_eos": True}
# 10^10 template steps: hours, however fast the machine; only a time limit ends it.
ENDLESS_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
)
TEMPLATE_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerProcess([llama_dir, "--served-model-name", "base"], api_key=API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def trusting_server(llama_dir):
    with ServerProcess(
        [llama_dir, "--served-model-name", "base", "--trust-request-chat-template",
         "--metrics-require-api-key", "--max-request-body-bytes", str(SMALL_BODY_LIMIT)],
        api_key=API_KEY, env={"LORASERVE_CHAT_TEMPLATE_TIMEOUT_S": str(TEMPLATE_TIMEOUT_S)},
    ) as srv:
        yield srv


def post_raw(server: ServerProcess, path: str, body: bytes, **kwargs) -> httpx.Response:
    headers = {**server.headers, "content-type": "application/json"}
    return httpx.post(server.url + path, content=body, headers=headers, timeout=60, **kwargs)


def openai_error(response: httpx.Response, status: int) -> dict:
    """The error of an OpenAI-shaped error response with this status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and error["message"], error
    return error


# -- token ids are checked against the model's vocabulary --------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**HELLO, "stop_token_ids": [1000000], "min_tokens": 2}),
    ("/v1/completions", {**HELLO, "stop_token_ids": [3, -1]}),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [VOCAB], "min_tokens": 1}),
])
def test_stop_token_ids_outside_the_vocabulary_are_400(server, path, body):
    error = openai_error(server.post(path, body), 400)
    bad = next(t for t in body["stop_token_ids"] if not 0 <= t < VOCAB)
    assert error["param"] == "stop_token_ids" and str(bad) in error["message"], error
    assert server.post("/v1/completions", HELLO).status_code == 200  # still serving


@pytest.mark.parametrize("prompt,bad", [
    ([5, 999999], 999999), ([[1, 2], [3, VOCAB]], VOCAB), ([-1], -1),
])
def test_prompt_token_ids_outside_the_vocabulary_are_400(server, prompt, bad):
    error = openai_error(server.post("/v1/completions", {**HELLO, "prompt": prompt}), 400)
    assert error["param"] == "prompt" and str(bad) in error["message"], error


@pytest.mark.parametrize("vocab_size,prompt,ok", [
    (VOCAB + 100, [VOCAB + 50], True),  # a row of the embedding the tokenizer lacks
    (VOCAB - 100, [VOCAB - 50], False),  # a token the embedding lacks
])
def test_prompt_ids_are_bounded_by_the_models_vocabulary_not_the_tokenizer(
    llama_dir, vocab_size, prompt, ok
):
    from transformers import AutoTokenizer

    from loraserve.entrypoints.errors import APIError

    tokenizer = RequestTokenizer(AutoTokenizer.from_pretrained(llama_dir))
    limits = ModelLimits(max_model_len=512, vocab_size=vocab_size)
    completion = OpenAIServingCompletion(None, None, tokenizer, limits)
    try:
        if ok:
            asyncio.run(completion._prompts(CompletionRequest(prompt=prompt)))
        else:
            with pytest.raises(APIError) as info:
                asyncio.run(completion._prompts(CompletionRequest(prompt=prompt)))
            assert info.value.status == 400 and str(prompt[0]) in info.value.message
    finally:
        tokenizer.shutdown()


# -- large bodies: 413 at the limit, nothing blocks the event loop -------------------


def test_a_body_over_the_limit_is_413_in_openai_shape(trusting_server):
    body = json.dumps({**HELLO, "prompt": "x" * (SMALL_BODY_LIMIT + 1000)}).encode()
    error = openai_error(post_raw(trusting_server, "/v1/completions", body), 413)
    assert str(SMALL_BODY_LIMIT) in error["message"]

    def chunks():  # no Content-Length: the server counts the bytes as they come
        for i in range(0, len(body), 50_000):
            yield body[i:i + 50_000]

    openai_error(post_raw(trusting_server, "/v1/completions", chunks()), 413)
    assert trusting_server.post("/v1/completions", HELLO).status_code == 200


def test_the_default_body_limit_is_16_mib(server):
    prompt = "x" * (16 * 1024 * 1024)

    def chunks():
        body = json.dumps({**HELLO, "prompt": prompt}).encode()
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]

    openai_error(post_raw(server, "/v1/completions", chunks()), 413)


HUGE_TEXT = "Once upon a time " * 900_000


@pytest.mark.parametrize("path,huge,param", [
    ("/v1/completions", {**HELLO, "prompt": HUGE_TEXT}, "prompt"),
    ("/tokenize", {"model": "base", "prompt": HUGE_TEXT}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": HUGE_TEXT}]},
     "messages"),
    ("/tokenize", {"model": "base", "messages": [{"role": "user", "content": HUGE_TEXT}]},
     "messages"),
])
def test_health_answers_while_a_huge_prompt_is_handled(server, path, huge, param):
    # 15 MB of text: far too long for a 512-token context, refused before it is
    # tokenized (tokenizing it would take seconds to minutes and gigabytes).
    result: dict = {}

    def send() -> None:
        result["response"] = server.post(path, huge)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    while sender.is_alive():
        health = httpx.get(server.url + "/health", timeout=3)
        assert health.status_code == 200
        time.sleep(0.05)
    sender.join()
    error = openai_error(result["response"], 400)
    assert "maximum context length is 512" in error["message"] and error["param"] == param


def test_detokenize_takes_at_most_a_context_of_tokens(server):
    full = server.post("/detokenize", {"model": "base", "tokens": [5] * 512})
    assert full.status_code == 200, full.text
    error = openai_error(server.post("/detokenize", {"model": "base", "tokens": [5] * 513}),
                         400)
    assert "maximum context length is 512" in error["message"] and error["param"] == "tokens"


def test_without_a_token_bound_a_prompt_is_capped_in_characters(llama_dir):
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    from loraserve.entrypoints.errors import APIError
    from loraserve.entrypoints.request_tokenizer import MAX_CHARS_PER_TOKEN
    from loraserve.entrypoints.serving_common import check_prompt_size

    hf = AutoTokenizer.from_pretrained(llama_dir)
    hf.backend_tokenizer.normalizer = normalizers.Lowercase()  # no bound holds then
    tokenizer = RequestTokenizer(hf)
    try:
        assert tokenizer.min_tokens("x" * 100_000) == 0
        most = 511 * MAX_CHARS_PER_TOKEN
        check_prompt_size(tokenizer, 512, "x" * most, "prompt")
        with pytest.raises(APIError) as info:
            check_prompt_size(tokenizer, 512, "x" * (most + 1), "prompt")
        assert info.value.status == 400 and info.value.param == "prompt"
        assert f"{most + 1} characters" in info.value.message
    finally:
        tokenizer.shutdown()


class _ThreadRecordingTokenizer:
    """A tokenizer that notes the thread of every call that grows with the input."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.threads: set[int] = set()

    def __call__(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return self._tokenizer(*args, **kwargs)

    def get_chat_template(self, *args, **kwargs):  # what a render starts with
        self.threads.add(threading.get_ident())
        return self._tokenizer.get_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        self.threads.add(threading.get_ident())
        return self._tokenizer.decode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_prompts_are_tokenized_and_rendered_off_the_event_loop(llama_dir):
    from transformers import AutoTokenizer

    recording = _ThreadRecordingTokenizer(AutoTokenizer.from_pretrained(llama_dir))
    tokenizer = RequestTokenizer(recording)
    limits = ModelLimits(max_model_len=512, vocab_size=VOCAB)
    completion = OpenAIServingCompletion(None, None, tokenizer, limits)
    chat = OpenAIServingChat(None, None, tokenizer, limits)

    async def run() -> int:
        await completion._prompts(CompletionRequest(prompt="Hello"))
        await completion._prompts(CompletionRequest(prompt=[5, 6, 7]))  # decoded for echo
        await chat.render_prompt(ChatCompletionRequest(**CHAT))
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
    finally:
        tokenizer.shutdown()
    assert recording.threads and loop_thread not in recording.threads


# -- chat templates from the request --------------------------------------------------


@pytest.mark.parametrize("extra", [
    {"chat_template": "{{ 'owned' }}"},
    {"chat_template_kwargs": {"chat_template": "{{ 'owned' }}"}},
])
def test_a_request_chat_template_is_refused_without_the_flag(server, extra):
    error = openai_error(server.post("/v1/chat/completions", {**CHAT, **extra}), 400)
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]
    tokenize = {"model": "base", "messages": CHAT["messages"], **extra}
    openai_error(server.post("/tokenize", tokenize), 400)


def test_chat_template_kwargs_may_not_steer_the_rendering(server):
    body = {**CHAT, "chat_template_kwargs": {"tokenize": True, "return_dict": True}}
    error = openai_error(server.post("/v1/chat/completions", body), 400)
    assert error["param"] == "chat_template_kwargs" and "return_dict" in error["message"]


def test_a_trusted_request_template_is_rendered_in_a_sandbox(trusting_server):
    body = {"model": "base", "messages": [{"role": "user", "content": "Hello"}],
            "chat_template": "{{ messages[0]['content'] }} world"}
    rendered = trusting_server.post("/tokenize", body).json()["tokens"]
    plain = trusting_server.post("/tokenize", {"model": "base", "prompt": "Hello world",
                                               "add_special_tokens": False}).json()["tokens"]
    assert rendered == plain
    escape = {**body, "chat_template": "{{ ''.__class__.__mro__ }}"}
    error = openai_error(trusting_server.post("/tokenize", escape), 400)
    assert "unsafe" in error["message"], error


def test_metrics_can_require_the_api_key(trusting_server, server):
    openai_error(httpx.get(trusting_server.url + "/metrics"), 401)
    assert trusting_server.get("/metrics").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200  # open by default


def test_an_endless_trusted_template_is_stopped_and_delays_no_one(trusting_server):
    chat = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    result: dict = {}

    def endless() -> None:
        result["response"] = trusting_server.post(
            "/tokenize", {**chat, "chat_template": ENDLESS_TEMPLATE})

    heavy = threading.Thread(target=endless, daemon=True)
    heavy.start()
    time.sleep(0.5)  # it renders meanwhile
    # Small requests that need the tokenizer threads are answered while it renders.
    small = trusting_server.post("/tokenize", {"model": "base", "prompt": "Hello"})
    assert small.status_code == 200, small.text
    rendered = trusting_server.post("/tokenize", chat)  # the server's own template
    assert rendered.status_code == 200, rendered.text
    answered = trusting_server.post("/v1/chat/completions", {**chat, "max_tokens": 2})
    assert answered.status_code == 200, answered.text
    assert httpx.get(trusting_server.url + "/health", timeout=3).status_code == 200
    assert heavy.is_alive()  # all of that while the template still ran
    heavy.join(timeout=60)
    error = openai_error(result["response"], 400)
    assert f"time limit of {TEMPLATE_TIMEOUT_S} s" in error["message"], error


@pytest.mark.parametrize("template", [
    "{{ 'x' * 10**10 }}",
    "{{ [0] * 10**10 }}",
    "{{ 'x'.center(10**10) }}",
    "{{ 'x'|center(10**10) }}",
    "{{ '{:>10000000000}'.format('x') }}",
    "{{ '%10000000000s' % 'x' }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{{ (('x' * 5000).replace('', 'y' * 5000))|length }}",
    "{{ range(5000)|map('string')|join('y' * 5000)|length }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
])
def test_a_trusted_template_cannot_make_huge_values(trusting_server, template):
    body = {"model": "base", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": template}
    error = openai_error(trusting_server.post("/tokenize", body), 400)
    assert "limit" in error["message"] and "characters" in error["message"], error
    assert trusting_server.post("/tokenize", {"model": "base", "prompt": "hi"}).status_code \
        == 200


def test_the_bounded_renderer_renders_as_transformers_does(llama_dir):
    from transformers import AutoTokenizer

    from loraserve.entrypoints.chat_template import ChatTemplateRenderer

    hf = AutoTokenizer.from_pretrained(llama_dir)
    renderer = ChatTemplateRenderer(hf, max_chars=100_000, timeout_s=5)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    template = (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% if tools %}{{ tools|tojson(indent=2) }}\n{% endif %}"
        "{%- for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}<{{ m['role'] }}>{% if m.role == 'assistant' %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content|trim }}"
        "{% endif %}\n{% endfor %}{{ dict(n=ns.n)|tojson }}{{ '%05d' % ns.n }}"
        "{% if add_generation_prompt %}<assistant>{% endif %}{{ extra | default('') }}"
    )
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "skip", "content": "x"},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    for kwargs in ({"add_generation_prompt": True, "tools": tools, "extra": "!"},
                   {"continue_final_message": True}, {"chat_template": None}):
        chosen = kwargs.pop("chat_template", template)
        expected = hf.apply_chat_template(messages, chat_template=chosen, tokenize=False,
                                          **kwargs)
        assert renderer.render(messages, chat_template=chosen, **kwargs) == expected, kwargs


# -- authentication ---------------------------------------------------------------


@pytest.mark.parametrize("method,path", [
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"), ("GET", "/redoc"),
    ("GET", "/openapi.json"), ("GET", "/v1/models"), ("POST", "/v1/completions"),
    ("GET", "/no/such/path"),
])
def test_the_api_key_guards_every_path_but_the_probes(server, method, path):
    body = {"model": "base", "prompt": "hi", "tokens": [1]} if method == "POST" else None
    openai_error(httpx.request(method, server.url + path, json=body), 401)
    wrong = {"Authorization": "Bearer wrong"}
    openai_error(httpx.request(method, server.url + path, json=body, headers=wrong), 401)
    if path not in ("/no/such/path", "/v1/completions"):
        assert httpx.request(method, server.url + path, json=body,
                             headers=server.headers).status_code == 200


@pytest.mark.parametrize("header,status", [
    (f"bearer {API_KEY}", 200), (f"BEARER {API_KEY}", 200), (f"Bearer  {API_KEY}", 200),
    (f"Bearer {API_KEY.upper()}", 401), (f"Basic {API_KEY}", 401), (API_KEY, 401),
])
def test_the_bearer_scheme_is_case_insensitive_and_the_key_is_not(server, header, status):
    response = httpx.get(server.url + "/v1/models", headers={"Authorization": header})
    assert response.status_code == status, response.text


def test_the_probes_answer_without_the_key(server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path


# -- bad values are 400s, not 500s -------------------------------------------------


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b'{"prompt": "He\\ud800llo", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "Hello", "max_tokens": 2, "stop": ["\\udfff"]}'),
    ("/v1/completions", b'{"prompt": "Hello", "max_tokens": 2, "model": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "He\xed\xa0\x80llo", "max_tokens": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}'),
    ("/tokenize", b'{"prompt": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "Hello", "temperature": Infinity}'),
    ("/v1/completions", b'{"prompt": "Hello", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": "Hello", "top_p": NaN}'),
    ("/v1/completions", b'{"prompt": "Hello", "presence_penalty": -Infinity}'),
    ("/v1/completions", b'{"prompt": "Hello", "temperature": 1e999}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"repetition_penalty": 1e999}'),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
    ("/v1/completions", b'{"prompt": "Hello", "response_format": [1]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                             b'"response_format": "json"}'),
])
def test_malformed_values_are_400(server, path, body):
    openai_error(post_raw(server, path, body), 400)


@pytest.mark.parametrize("field,value", [
    ("seed", 2**70), ("seed", 2**64), ("seed", -(2**63) - 1), ("top_k", 2**70),
    ("min_tokens", 2**64), ("max_tokens", 2**70), ("logprobs", 2**70), ("n", 2**70),
])
def test_integers_beyond_64_bits_are_400(server, field, value):
    error = openai_error(server.post("/v1/completions", {**HELLO, field: value}), 400)
    assert error["param"] == field


@pytest.mark.parametrize("seed,n", [(-(2**63), 1), (2**63 - 1, 2), (-1, 1)])
def test_seeds_across_the_signed_64_bit_range_work(server, seed, n):
    response = server.post("/v1/completions", {**HELLO, "seed": seed, "n": n})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == n


@pytest.mark.parametrize("body,param", [
    ({**HELLO, "n": 129}, "n"),
    ({**HELLO, "n": 20000}, "n"),
    ({**HELLO, "prompt": ["Hello"] * 9, "n": 128}, "prompt"),
    ({**HELLO, "min_tokens": 5}, "min_tokens"),
    ({**HELLO, "stop": ["x"] * 65}, "stop"),
])
def test_requests_beyond_the_limits_are_400(server, body, param):
    error = openai_error(server.post("/v1/completions", body), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize("path,messages", [
    ("/v1/chat/completions", [{"role": "user", "content": None}]),
    ("/v1/chat/completions", [{"role": "system", "content": "Be brief."}, {"role": "user"}]),
    ("/v1/chat/completions", [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": None}]),
    ("/tokenize", [{"role": "user", "content": None}]),
])
def test_a_message_without_content_is_a_400_naming_the_field(server, path, messages):
    body = {**CHAT, "messages": messages}
    error = openai_error(server.post(path, body), 400)
    index = len(messages) - 1
    assert error["param"] == f"messages.[{index}].content", error
    assert f"messages[{index}].content" in error["message"], error
    assert "chat template" not in error["message"], error


def test_an_assistant_message_with_tool_calls_may_have_null_content(server):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": "{}"}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    response = server.post("/v1/chat/completions", {**CHAT, "messages": messages})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {**HELLO, "logprobs": -1}, "logprobs"),
])
def test_a_bad_logprobs_count_names_the_field_the_request_set(server, path, body, param):
    error = openai_error(server.post(path, body), 400)
    assert error["param"] == param and param in error["message"], error


_ints = st.one_of(st.integers(-3, 4), st.integers(-(2**70), 2**70))
_floats = st.floats(allow_nan=True, allow_infinity=True)
_texts = st.one_of(st.text(max_size=8), st.sampled_from(["", "\ud800", "<|im_end|>"]))
_json = st.recursive(st.one_of(st.none(), st.booleans(), _ints, _floats, _texts),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(_texts, inner, max_size=2)),
                     max_leaves=5)
_sampling = {
    "n": _ints, "temperature": _floats, "top_p": _floats, "top_k": _ints, "min_p": _floats,
    "seed": _ints, "presence_penalty": _floats, "repetition_penalty": _floats,
    "max_tokens": st.one_of(st.integers(-1, 3), _ints), "min_tokens": _ints,
    "logprobs": st.one_of(st.integers(-1, 21), _json), "stop": st.one_of(_texts, _json),
    "stop_token_ids": st.one_of(st.lists(_ints, max_size=3), _json), "best_of": _ints,
    "echo": _json, "stream": st.booleans(), "logit_bias": _json, "stream_options": _json,
    "top_logprobs": _ints, "chat_template_kwargs": _json, "response_format": _json,
}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(st.fixed_dictionaries({"prompt": st.one_of(_texts, _json)}, optional=_sampling),
       st.fixed_dictionaries({"messages": st.one_of(
           st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": _json}),
                    max_size=2), _json)}, optional=_sampling))
def test_fuzzed_requests_never_get_a_5xx(server, completion, chat):
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        body.setdefault("max_tokens", 2)
        if isinstance(body["max_tokens"], int) and 0 < body["max_tokens"] < 2**31:
            body["max_tokens"] = min(body["max_tokens"], 3)
        raw = json.dumps(body).encode("utf-8", "surrogatepass")
        response = post_raw(server, path, raw)
        assert response.status_code < 500, (raw, response.text)
        assert "InternalServerError" not in response.text, (raw, response.text)
        if response.status_code >= 400:
            openai_error(response, response.status_code)


# -- SIGTERM drains, SIGKILL leaves nothing ------------------------------------------


def _stream(server: ServerProcess, body: dict, results: list) -> None:
    lines = []
    try:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={**body, "stream": True}, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line]
        results.append(("stream", response.status_code, lines))
    except httpx.HTTPError as exc:
        results.append(("stream", type(exc).__name__, lines))


def _plain(server: ServerProcess, body: dict, results: list) -> None:
    try:
        response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        results.append(("plain", response.status_code, response.json()))
    except httpx.HTTPError as exc:
        results.append(("plain", type(exc).__name__, None))


def _requests_in_engine(server: ServerProcess) -> float:
    """The requests the engine holds now, running or waiting."""
    found = {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}
    return sum(found[name].samples[0].value
               for name in ("loraserve:num_requests_running", "loraserve:num_requests_waiting"))


def test_sigterm_answers_every_request_in_flight_in_openai_shape(llama_dir):
    # One sequence at a time, so that most requests are still running at the deadline.
    server = ServerProcess([llama_dir, "--served-model-name", "base", "--max-num-seqs", "1",
                            "--shutdown-timeout", "1"])
    try:
        results: list = []
        threads = [threading.Thread(target=target, args=(server, LONG, results), daemon=True)
                   for target in (_stream, _plain, _stream, _plain)]
        for thread in threads:
            thread.start()
        # All four are in the engine (most of them waiting for the one sequence slot).
        assert wait_until(lambda: _requests_in_engine(server) == 4, 30), \
            server.output()
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: server.proc.poll() is not None, 20), server.output()
        for thread in threads:
            thread.join(timeout=10)
        assert server.proc.returncode == 0, server.output()
        assert len(results) == 4, results
        ended_early = 0
        for kind, status, payload in results:
            assert status == 200 or (kind == "plain" and status == 503), (kind, status, payload)
            if kind == "plain" and status == 503:
                assert payload["error"]["code"] == 503
                ended_early += 1
            elif kind == "plain":
                assert payload["choices"][0]["finish_reason"] == "length"
            else:
                assert payload[-1] == "data: [DONE]", payload
                last = json.loads(payload[-2].removeprefix("data: "))
                if "error" in last:
                    assert last["error"]["code"] == 503
                    ended_early += 1
                else:
                    assert last["choices"][0]["finish_reason"] == "length"
        assert ended_early, results  # the deadline did end some of them
        assert "Traceback" not in server.output(), server.output()
    finally:
        server.kill()


def test_sigkill_of_the_api_server_leaves_no_socket_files(llama_dir):
    server = ServerProcess([llama_dir, "--served-model-name", "base"])
    try:
        engine = server.engine_pid()
        paths = unix_socket_paths(server.proc.pid)
        assert paths, "the API server holds no unix sockets"
        server.proc.kill()
        server.proc.wait(timeout=5)
        assert wait_until(lambda: not alive(engine), 10), "the engine outlived its parent"
        left = [p for p in paths if os.path.exists(p) or os.path.exists(os.path.dirname(p))]
        assert not left, left
    finally:
        server.kill()


def test_a_later_start_removes_socket_dirs_of_dead_processes(tmp_path):
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = tmp_path / f"{IPC_DIR_PREFIX}{gone.pid}-abc"
    live = tmp_path / f"{IPC_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "loraserve-something-else"
    for path in (stale, live, other):
        path.mkdir()
    remove_stale_ipc_dirs(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()


def test_help_names_the_builtin_models_and_the_new_flags(capsys):
    from loraserve.cli_args import build_parser
    from loraserve.model.builtin import BUILTIN_MODELS

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for word in [*BUILTIN_MODELS, "--metrics-require-api-key", "--trust-request-chat-template",
                 "--max-request-body-bytes", "--shutdown-timeout"]:
        assert word in text, word
