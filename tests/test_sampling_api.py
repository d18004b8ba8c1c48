"""The sampling controls and beam search through `loraserve serve`, on
/v1/completions and /v1/chat/completions, for the base model and an adapter:
logit_bias, allowed_token_ids, bad_words, min_p, priority (with
--scheduling-policy priority), use_beam_search with n, best_of and
length_penalty against the transformers reference, and a 400 naming the field for
what cannot be served."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from beam_reference import Reference
from serve_utils import ServerProcess
from utils import clean_word, contains

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello there"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    with ServerProcess([
        llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", "16", "--lora-modules", f"a8={llama_adapters['r8']}",
        "--scheduling-policy", "priority",
    ]) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


def _post(server, endpoint: str, body: dict) -> dict:
    response = server.post(f"/v1/{endpoint}", body)
    assert response.status_code == 200, response.text
    return response.json()


def _body(endpoint: str, model: str, **fields) -> dict:
    body = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, **fields}
    if endpoint == "completions":
        return {"prompt": PROMPT, "logprobs": 0, **body}
    return {"messages": CHAT, "logprobs": True, **body}


def _token_ids(endpoint: str, choice: dict) -> list[int]:
    if endpoint == "completions":
        tokens = choice["logprobs"]["tokens"]
    else:
        tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _generate(server, endpoint: str, model: str, **fields) -> list[int]:
    (choice,) = _post(server, endpoint, _body(endpoint, model, **fields))["choices"]
    return _token_ids(endpoint, choice)


ROUTES = [("completions", "base"), ("chat/completions", "a8")]


@pytest.mark.parametrize(("endpoint", "model"), ROUTES)
def test_logit_bias_forces_a_token_and_removes_the_greedy_one(server, endpoint, model):
    plain = _generate(server, endpoint, model)
    assert 17 not in plain
    assert _generate(server, endpoint, model, logit_bias={"17": 100}) == [17] * MAX_TOKENS
    assert _generate(server, endpoint, model, logit_bias={str(plain[0]): -100})[0] != plain[0]


@pytest.mark.parametrize(("endpoint", "model"), ROUTES)
def test_only_allowed_token_ids_are_generated(server, endpoint, model):
    allowed = [5, 40, 41, 200, 377]
    for temperature in (0, 1.3):
        ids = _generate(server, endpoint, model, allowed_token_ids=allowed,
                        temperature=temperature, seed=4)
        assert len(ids) == MAX_TOKENS and set(ids) <= set(allowed)


# (The adapters' text here has no whole word to ban: tests/test_logit_controls.py
# checks bad words with adapters.)
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_bad_words_are_not_generated(server, tokenizer, endpoint):
    model = "base"
    plain = _generate(server, endpoint, model, max_tokens=16)
    word, word_ids = clean_word(tokenizer, plain, 2)
    assert contains(plain, word_ids)
    banned = _generate(server, endpoint, model, max_tokens=16, bad_words=[word])
    assert not contains(banned, word_ids) and banned != plain


@pytest.mark.parametrize(("endpoint", "model"), ROUTES)
def test_min_p_one_keeps_only_the_most_likely_token(server, endpoint, model):
    greedy = _generate(server, endpoint, model)
    hot = _generate(server, endpoint, model, temperature=2.0, seed=11)
    assert hot != greedy, "at temperature 2 the draw should leave the greedy path"
    assert _generate(server, endpoint, model, temperature=2.0, seed=11, min_p=1.0) == greedy


@pytest.mark.parametrize(("endpoint", "model"), ROUTES)
def test_a_priority_is_served_under_the_priority_policy(server, endpoint, model):
    assert len(_generate(server, endpoint, model, priority=-7)) == MAX_TOKENS


@pytest.mark.parametrize(("endpoint", "fields", "param"), [
    ("completions", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"fox": 1}}, "logit_bias"),
    ("completions", {"allowed_token_ids": [3, 999999]}, "allowed_token_ids"),
    ("chat/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"bad_words": ["ok"] * 129}, "bad_words"),
    ("chat/completions", {"bad_words": [" "]}, "bad_words"),
    ("completions", {"use_beam_search": True, "stream": True}, "stream"),
    ("completions", {"use_beam_search": True, "logit_bias": {"3": 1}}, "logit_bias"),
    ("chat/completions", {"use_beam_search": True, "repetition_penalty": 1.2},
     "repetition_penalty"),
    ("completions", {"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
    ("completions", {"n": 2, "best_of": 3}, "best_of"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, endpoint, fields, param):
    body = _body(endpoint, "base", **fields)
    response = server.post(f"/v1/{endpoint}", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"].lower(), error
    assert len(_generate(server, endpoint, "base")) == MAX_TOKENS  # still serving


# ---- beam search -------------------------------------------------------------------


def _reference_beams(llama_dir, llama_adapters, model, prompt_ids, **kw):
    adapter = llama_adapters["r8"] if model == "a8" else None
    return Reference(llama_dir, adapter).beam_search(prompt_ids, **kw)


def test_completion_beams_match_the_reference_for_base_and_adapter_at_once(
    server, tokenizer, llama_dir, llama_adapters,
):
    """Two beam searches at once, one per model, whose steps share engine steps."""
    prompt_ids = tokenizer(PROMPT).input_ids
    fields = dict(use_beam_search=True, n=2, best_of=3, length_penalty=0.5, max_tokens=5,
                  min_tokens=2)
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(
            lambda model: _post(server, "completions", _body("completions", model, **fields)),
            ["base", "a8"]))
    for model, answer in zip(["base", "a8"], answers, strict=True):
        expected = _reference_beams(
            llama_dir, llama_adapters, model, prompt_ids, width=3, n=2, max_tokens=5,
            eos=tokenizer.eos_token_id, length_penalty=0.5, ignore_eos=True, min_tokens=2)
        choices = answer["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert [_token_ids("completions", c) for c in choices] == \
            [b.token_ids for b in expected], model
        for choice, beam in zip(choices, expected, strict=True):
            assert choice["text"] == tokenizer.decode(beam.token_ids, skip_special_tokens=True)
            assert choice["finish_reason"] == ("stop" if beam.finished else "length")
        assert answer["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in expected)


def test_chat_beams_stream_as_one_chunk_each_and_match_the_reference(
    server, tokenizer, llama_dir, llama_adapters,
):
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(rendered, add_special_tokens=False).input_ids
    body = {"model": "a8", "messages": CHAT, "use_beam_search": True, "n": 2,
            "max_tokens": 4, "include_stop_str_in_output": True}
    expected = _reference_beams(llama_dir, llama_adapters, "a8", prompt_ids, width=2, n=2,
                                max_tokens=4, eos=tokenizer.eos_token_id,
                                include_stop_str_in_output=True)
    full = _post(server, "chat/completions", body)
    texts = [c["message"]["content"] for c in full["choices"]]
    eos = tokenizer.eos_token_id
    assert texts == [tokenizer.decode([t for t in b.token_ids if t != eos],
                                      skip_special_tokens=True) for b in expected]
    assert full["usage"]["completion_tokens"] == sum(len(b.token_ids) for b in expected)
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            streamed[choice["index"]] = streamed.get(choice["index"], "") + \
                choice["delta"].get("content", "")
            if choice.get("finish_reason"):
                finish[choice["index"]] = choice["finish_reason"]
    assert [streamed[i] for i in range(2)] == texts
    assert [finish[i] for i in range(2)] == [c["finish_reason"] for c in full["choices"]]
