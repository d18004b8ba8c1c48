"""No input gets a server error: every operation of the server's own OpenAPI
schema is fuzzed with schemathesis against a real server, and hand-written nasty
bodies (lone surrogates, huge numbers, non-finite floats, out-of-range token
ids, a 20 MB body, a request-supplied chat template) are each refused with a
clear 4xx in OpenAI's error shape, or served."""

from __future__ import annotations

import json
import zlib
from typing import Any

import httpx
import pytest
import schemathesis
from fault_utils import (
    assert_complete,
    assert_openai_error,
    call,
    completion_body,
    engine_stats,
    openai_error_problems,
    start_server,
    token_ids,
    wait_engine_idle,
)
from hypothesis import HealthCheck, Phase, settings

# Each schemathesis call and each nasty request gets this long; a hang fails.
CALL_TIMEOUT_S = 30.0
# Per operation: with the 11 operations, the fuzzing takes about a minute.
MAX_EXAMPLES = 30
# The served names that most fuzzed bodies are pointed at (see _aim).
KNOWN_MODELS = ("base", "a0")
GENERATING_PATHS = ("/v1/completions", "/v1/chat/completions")


def _serve(llama_dir: str, llama_adapters: dict[str, str]):
    # A short context and many sequences per step: even the largest request the
    # server accepts finishes in seconds, so a case that times out is a real hang.
    return start_server(
        [llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
         "--max-cpu-loras", "2", "--max-model-len", "64", "--max-num-seqs", "128",
         "--lora-modules", f"a0={llama_adapters['r8']}"],
        env={"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )


# Two servers, so that a case that breaks one cannot hide what the other finds.
@pytest.fixture(scope="module")
def fuzz_server(llama_dir, llama_adapters):
    with _serve(llama_dir, llama_adapters) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    with _serve(llama_dir, llama_adapters) as srv:
        yield srv


def _base_answer(server) -> list[int]:
    return token_ids(call(server.url, "/v1/completions",
                          completion_body("base", "Hello world!", 6)))[0]


@pytest.fixture(scope="module")
def fuzz_reference(fuzz_server) -> list[int]:
    """The base model's greedy answer before any fuzzing, to check it after."""
    return _base_answer(fuzz_server)


@pytest.fixture(scope="module")
def base_reference(server) -> list[int]:
    return _base_answer(server)


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    # An explicit configuration, so no schemathesis.toml found on disk applies. Its
    # changes: failure reports show fields like `min_tokens` instead of hiding them
    # as secrets; and a stream is read to its end (schemathesis stops after 20
    # events by default, which would cut off the [DONE] the test checks for; the
    # call's timeout still bounds a stream that never ends).
    config = schemathesis.Config.from_dict({
        "output": {"sanitization": {"enabled": False}},
        "max-stream-events": 1_000_000,
    })
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)


lazy_schema = schemathesis.pytest.from_fixture("api_schema")


def assert_responsive(server) -> None:
    """Fail at once, rather than by a timeout per case, once an earlier case has
    left the server unable to answer."""
    try:
        status = httpx.get(server.url + "/health", timeout=5).status_code
    except httpx.HTTPError as exc:
        pytest.fail(f"the server no longer answers /health: {exc!r}")
    assert status == 200, f"/health answers {status}"


def _aim(case: Any) -> None:
    """Steer two cases in three (picked by a hash of the body, so a case stays
    reproducible) at a served model and past the checks that refuse a field on
    purpose, so that generated bodies reach the engine and its sampling instead of
    stopping at "model not found" or "suffix is not supported"; sizes are kept
    small so each such case is quick. The third case stays as generated."""
    body = case.body
    if not isinstance(body, dict):
        return
    pick = zlib.crc32(json.dumps(body, sort_keys=True, default=repr).encode()) % 3
    if pick == 2:
        return
    if "model" in body or case.path in GENERATING_PATHS:
        body["model"] = KNOWN_MODELS[pick]
    if case.path not in GENERATING_PATHS:
        return
    for name in ("best_of", "suffix", "logit_bias"):
        body.pop(name, None)
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if isinstance(body.get("n"), int):
        body["n"] = 1 + abs(body["n"]) % 3
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int):
            body[name] = 1 + abs(body[name]) % 8
    if case.path == "/v1/completions" and body.get("prompt") in ("", [], None):
        body["prompt"] = "hi"
    if case.path == "/v1/chat/completions":
        if body.get("logprobs") is not True:
            body.pop("top_logprobs", None)
        if not body.get("messages"):
            body["messages"] = [{"role": "user", "content": "hi"}]


def _sse_problems(text: str) -> list[str]:
    """An SSE answer ends with [DONE], and its error events are OpenAI-shaped."""
    data = [line.removeprefix("data: ") for line in text.splitlines()
            if line.startswith("data: ")]
    if not data or data[-1] != "[DONE]":
        return [f"the stream does not end with [DONE]: {text[-300:]!r}"]
    problems = []
    for item in data[:-1]:
        event = json.loads(item)
        if "error" in event:
            problems += openai_error_problems(event)
            if int(event["error"].get("code") or 0) >= 500:
                problems.append(f"server error in the stream: {event}")
    return problems


@pytest.mark.usefixtures("fuzz_reference")
@lazy_schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
          # Shrinking a slow failure (a hang, a huge n) costs minutes: report it as found.
          phases=[Phase.explicit, Phase.reuse, Phase.generate], report_multiple_bugs=False,
          suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_get_no_server_error(case, fuzz_server):
    assert_responsive(fuzz_server)
    _aim(case)
    response = case.call(base_url=fuzz_server.url, timeout=CALL_TIMEOUT_S)
    text = response.content.decode("utf-8", errors="replace")
    where = f"{response.status_code} for {case.as_curl_command()}\n{text[:500]}"
    assert response.status_code < 500, where
    if response.status_code >= 400:
        try:
            error_body: Any = json.loads(text)
        except ValueError:
            error_body = text
        problems = openai_error_problems(error_body)
        assert not problems, f"{problems}: {where}"
    content_type = response.headers.get("content-type", [""])[0]
    if content_type.startswith("text/event-stream"):
        problems = _sse_problems(text)
        assert not problems, f"{problems}: {where}"


def test_server_is_healthy_after_fuzzing(fuzz_server, fuzz_reference):
    assert_healthy(fuzz_server, fuzz_reference)


def assert_healthy(server, reference: list[int]) -> None:
    assert_responsive(server)
    assert wait_engine_idle(server), engine_stats(server)
    assert _base_answer(server) == reference


BIG = 2**70
HELLO = [{"role": "user", "content": "hi"}]


def _completion(**fields: Any) -> dict:
    return {"model": "base", "prompt": "hi", "max_tokens": 4, **fields}


def _chat(**fields: Any) -> dict:
    return {"model": "base", "messages": HELLO, "max_tokens": 4, **fields}


# (id, path, body, the statuses that are right). json.dumps writes NaN and
# Infinity as the bare words (not JSON, but what clients send) and lone
# surrogates as \ud800 escapes, which JSON parsers accept.
NASTY: list[tuple[str, str, dict, set[int]]] = [
    ("surrogate-prompt", "/v1/completions", _completion(prompt="\ud800"), {400}),
    ("surrogate-prompt-list", "/v1/completions", _completion(prompt=["ok", "a\udfffb"]), {400}),
    ("surrogate-message", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": "\ud800"}]), {400}),
    ("surrogate-content-part", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]),
     {400}),
    ("surrogate-role", "/v1/chat/completions",
     _chat(messages=[{"role": "\ud800", "content": "hi"}]), {400}),
    ("surrogate-stop", "/v1/completions", _completion(stop=["\ud800"]), {400}),
    ("surrogate-stop-chat", "/v1/chat/completions", _chat(stop="\ud800"), {400}),
    ("surrogate-tokenize", "/tokenize", {"model": "base", "prompt": "\ud800"}, {400}),
    ("surrogate-model", "/v1/completions", _completion(model="\ud800"), {400, 404}),
    ("surrogate-lora-name", "/v1/load_lora_adapter",
     {"lora_name": "\ud800", "lora_path": "/nowhere"}, {400}),
    ("surrogate-lora-path", "/v1/load_lora_adapter",
     {"lora_name": "x", "lora_path": "/tmp/\ud800"}, {400, 404}),
    ("nul-lora-path", "/v1/load_lora_adapter",
     {"lora_name": "x", "lora_path": "/tmp/a\u0000b"}, {400, 404}),
    ("seed-2**70", "/v1/completions", _completion(seed=BIG), {400}),
    ("seed-2**70-chat", "/v1/chat/completions", _chat(seed=BIG), {400}),
    ("temperature-Infinity", "/v1/completions", _completion(temperature=float("inf")), {400}),
    ("temperature-NaN", "/v1/completions", _completion(temperature=float("nan")), {400}),
    ("temperature-Infinity-chat", "/v1/chat/completions", _chat(temperature=float("inf")),
     {400}),
    ("top_p-NaN", "/v1/completions", _completion(top_p=float("nan")), {400}),
    ("min_p-NaN", "/v1/completions", _completion(min_p=float("nan")), {400}),
    ("penalty--Infinity", "/v1/completions", _completion(frequency_penalty=float("-inf")),
     {400}),
    ("repetition_penalty-Infinity", "/v1/chat/completions",
     _chat(repetition_penalty=float("inf")), {400}),
    ("top_k-2**70", "/v1/completions", _completion(top_k=BIG), {400}),
    ("min_tokens-2**70", "/v1/completions", _completion(min_tokens=BIG), {400}),
    # Streamed: refused before the stream starts, not by cutting it short.
    ("min_tokens-2**70-stream", "/v1/chat/completions",
     _chat(min_tokens=BIG, n=2, stream=True), {400}),
    ("seed-2**70-stream", "/v1/completions", _completion(seed=BIG, stream=True), {400}),
    ("stop_token_ids-out-of-vocab", "/v1/completions",
     _completion(stop_token_ids=[10**6]), {200, 400}),
    ("stop_token_ids-negative", "/v1/completions", _completion(stop_token_ids=[-1]),
     {200, 400}),
    ("stop_token_ids-2**70", "/v1/chat/completions", _chat(stop_token_ids=[BIG]), {400}),
    ("prompt-ids-out-of-vocab", "/v1/completions", _completion(prompt=[1, 10**6]), {400}),
    ("prompt-ids-negative", "/v1/completions", _completion(prompt=[-5, 3]), {400}),
    ("prompt-ids-2**70", "/v1/completions", _completion(prompt=[[1, 2], [BIG]]), {400}),
    ("max_tokens-huge", "/v1/completions", _completion(max_tokens=10**30), {400}),
    ("max_tokens-2**63", "/v1/chat/completions", _chat(max_tokens=2**63), {400}),
    ("max_completion_tokens-huge", "/v1/chat/completions",
     _chat(max_completion_tokens=10**30), {400}),
    ("logprobs-1000", "/v1/completions", _completion(logprobs=1000), {400}),
    ("top_logprobs-1000", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=1000),
     {400}),
    ("prompt-empty-list", "/v1/completions", _completion(prompt=[]), {400}),
    ("prompt-empty-inner-list", "/v1/completions", _completion(prompt=[[]]), {400}),
    ("prompt-one-empty-of-two", "/v1/completions", _completion(prompt=[[1], []]), {400}),
    ("prompt-empty-string-in-list", "/v1/completions", _completion(prompt=[""]), {400}),
    ("prompt-nested-three-deep", "/v1/completions", _completion(prompt=[[[1]]]), {400}),
    ("prompt-mixed-list", "/v1/completions", _completion(prompt=["a", [1]]), {400}),
    ("messages-empty", "/v1/chat/completions", _chat(messages=[]), {400}),
    ("messages-nested", "/v1/chat/completions", _chat(messages=[[HELLO]]), {400}),
    ("chat_template_kwargs-template", "/v1/chat/completions",
     _chat(chat_template_kwargs={"chat_template": "{{ 'owned' }}"}), {400}),
    ("chat_template-field", "/v1/chat/completions", _chat(chat_template="{{ 'owned' }}"),
     {400}),
    ("detokenize-2**70", "/detokenize", {"model": "base", "tokens": [BIG]}, {400}),
    ("detokenize-negative", "/detokenize", {"model": "base", "tokens": [-1]}, {400}),
    ("unload-id-2**70", "/v1/unload_lora_adapter",
     {"lora_name": "nope", "lora_int_id": BIG}, {400, 404}),
    # Last: a server that takes these at face value stops answering anyone.
    ("n-20000", "/v1/completions", _completion(n=20000, max_tokens=1), {400}),
    ("n-2**70", "/v1/chat/completions", _chat(n=BIG), {400}),
    ("best_of-2**70", "/v1/completions", _completion(n=BIG, best_of=BIG), {400}),
]


# base_reference first: it must be taken before any nasty body reaches the server.
@pytest.mark.usefixtures("base_reference")
def test_raw_non_finite_json_is_refused(server):
    # Spelled out, in case a JSON library would not write these words.
    for raw in (b'{"model": "base", "prompt": "hi", "temperature": Infinity}',
                b'{"model": "base", "prompt": "hi", "temperature": NaN}',
                b'{"model": "base", "prompt": "hi", "top_p": -Infinity}'):
        reply = call(server.url, "/v1/completions", content=raw, timeout=CALL_TIMEOUT_S)
        assert reply.status == 400, (raw, reply.describe())
        assert_openai_error(reply.body, 400)


@pytest.mark.usefixtures("base_reference")
def test_20mb_body_is_refused_with_413(server):
    body = json.dumps(_completion(prompt="a " * (10 * 2**20))).encode()
    assert len(body) > 20 * 2**20
    reply = call(server.url, "/v1/completions", content=body, timeout=CALL_TIMEOUT_S)
    assert reply.status == 413, reply.describe()
    assert_openai_error(reply.body, 413)


@pytest.mark.usefixtures("base_reference")
@pytest.mark.parametrize(("path", "body", "statuses"), [case[1:] for case in NASTY],
                         ids=[case[0] for case in NASTY])
def test_nasty_body_is_refused_or_served(server, path, body, statuses):
    assert_responsive(server)
    reply = call(server.url, path, content=json.dumps(body).encode(), timeout=CALL_TIMEOUT_S)
    assert reply.exception is None, reply.describe()
    assert reply.status in statuses, reply.describe()
    if reply.status == 200:
        assert_complete(reply)
    else:
        assert_openai_error(reply.body, reply.status)


def test_server_is_healthy_after_nasty_bodies(server, base_reference):
    assert_healthy(server, base_reference)
