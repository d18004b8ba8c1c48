"""`loraserve serve` end to end, through the official openai client: the tokens of
the base model and of two PEFT adapters equal transformers+PEFT greedy decoding,
streaming and not, chat and completions; plus concurrency with --max-loras 1,
errors in OpenAI's shape, the API key, client disconnects and /metrics."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServerProcess, wait_until
from utils import hf_greedy

API_KEY = "test-key-123"
MAX_TOKENS = 8
COMPLETION_PROMPT = "The quick brown fox"
CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
EXTRA = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def adapters(llama_adapters) -> dict[str, str | None]:
    return {"base": None, "sql": llama_adapters["r8"], "poet": llama_adapters["r16_qv"]}


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    with ServerProcess(
        [
            llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "1",
            "--max-cpu-loras", "2", "--max-num-seqs", "16",
            "--lora-modules", f"sql={adapters['sql']}",
            json.dumps({"name": "poet", "path": adapters["poet"]}),
        ],
        api_key=API_KEY,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> dict[str, list[int]]:
    chat = tokenizer.apply_chat_template(CHAT_MESSAGES, tokenize=False,
                                         add_generation_prompt=True)
    return {
        "completion": tokenizer(COMPLETION_PROMPT).input_ids,
        "chat": tokenizer(chat, add_special_tokens=False).input_ids,
    }


@pytest.fixture(scope="module")
def expected(llama_dir, adapters, prompt_ids) -> dict[tuple[str, str], list[int]]:
    """transformers+PEFT greedy tokens for each (model name, endpoint)."""
    return {
        (name, kind): hf_greedy(llama_dir, path, ids, MAX_TOKENS)
        for name, path in adapters.items()
        for kind, ids in prompt_ids.items()
    }


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def completion_ids(client, model: str, stream: bool) -> list[int]:
    kwargs = dict(model=model, prompt=COMPLETION_PROMPT, logprobs=0, extra_body=EXTRA, **GREEDY)
    if not stream:
        choice = client.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length"
        return _ids(choice.logprobs.tokens)
    tokens, text = [], ""
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs:
                tokens += choice.logprobs.tokens
    return _ids(tokens)


def chat_ids(client, model: str, stream: bool) -> list[int]:
    kwargs = dict(model=model, messages=CHAT_MESSAGES, logprobs=True, extra_body=EXTRA,
                  **GREEDY)
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.role == "assistant"
        return _ids([c.token for c in choice.logprobs.content])
    tokens = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                tokens += [c.token for c in choice.logprobs.content]
    return _ids(tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("model", ["base", "sql", "poet"])
def test_completions_match_transformers(client, expected, model, stream):
    assert completion_ids(client, model, stream) == expected[(model, "completion")]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("model", ["base", "sql", "poet"])
def test_chat_matches_transformers(client, expected, model, stream):
    assert chat_ids(client, model, stream) == expected[(model, "chat")]


def test_text_matches_decoded_reference(client, expected, tokenizer):
    choice = client.completions.create(model="sql", prompt=COMPLETION_PROMPT,
                                       extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert choice.text == tokenizer.decode(expected[("sql", "completion")],
                                           skip_special_tokens=True)


def test_the_adapters_change_the_output(expected):
    # Otherwise the comparisons above would not tell the adapters apart.
    assert len({tuple(expected[(m, "completion")]) for m in ("base", "sql", "poet")}) == 3


def test_stream_usage_and_done(server):
    body = {"model": "poet", "prompt": COMPLETION_PROMPT, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY, **EXTRA}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2].removeprefix("data: "))
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == MAX_TOKENS


def test_models_lists_base_and_adapters(client, llama_dir, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "sql", "poet"}
    assert cards["sql"].root == adapters["sql"] and cards["sql"].parent == "base"
    assert cards["poet"].root == adapters["poet"]


def test_concurrent_requests_respect_max_loras(server, client, expected):
    """12 requests over two adapters with --max-loras 1: all correct, and the
    scheduler never runs both adapters at once."""
    seen: list[str] = []
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            text = server.get("/metrics").text
            for family in text_string_to_metric_families(text):
                if family.name == "loraserve:lora_requests_info":
                    seen.extend(s.labels["running_lora_adapters"] for s in family.samples)
            time.sleep(0.01)

    jobs = [("sql" if i % 2 else "poet", i % 3 == 0, i % 4 < 2) for i in range(12)]

    def run(job):
        model, stream, chat = job
        if chat:
            return chat_ids(client, model, stream) == expected[(model, "chat")]
        return completion_ids(client, model, stream) == expected[(model, "completion")]

    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(run, jobs, timeout=300))
    finally:
        stop.set()
        scraper.join(timeout=10)
    # Every answer is its own adapter's (so both adapters ran), and the running set
    # the scraper saw, one current series at a time, never held two adapters.
    assert all(results), results
    assert set(seen) & {"sql", "poet"}, seen  # the scraper saw requests running
    assert all("," not in running for running in seen), sorted(set(seen))


def test_unknown_model_is_404_in_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert "nope" in info.value.message
    body = server.post("/v1/chat/completions", {"model": "nope", "messages": CHAT_MESSAGES})
    assert body.status_code == 404
    error = body.json()["error"]
    assert error["type"] == "NotFoundError" and error["code"] == 404


@pytest.mark.parametrize("body", [
    {"model": "sql", "prompt": "hi", "temperature": -1},
    {"model": "sql", "prompt": "hi", "max_tokens": 100000},
    {"model": "sql", "prompt": "hi", "top_p": 0},
    {"model": "sql", "prompt": ""},
    {"model": "sql", "prompt": [999999]},
    {"model": "sql", "prompt": 5},
    {"model": "sql"},
    {"model": "sql", "prompt": "hi", "logprobs": 50},
    {"model": "sql", "prompt": "hi", "stream_options": {"include_usage": True}},
    {"model": "sql", "prompt": "hi", "suffix": "x"},
    {"model": "sql", "prompt": "hi", "logit_bias": {"999999": 5}},
])
def test_invalid_completion_is_400(server, body):
    response = server.post("/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["message"]


@pytest.mark.parametrize("body", [
    {"model": "sql", "messages": []},
    {"model": "sql", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    {"model": "sql", "messages": CHAT_MESSAGES, "top_logprobs": 2},
    {"model": "sql", "messages": CHAT_MESSAGES, "max_completion_tokens": 0},
])
def test_invalid_chat_is_400(server, body):
    response = server.post("/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == 400


def test_malformed_json_is_400(server):
    response = httpx.post(server.url + "/v1/completions", content=b"{not json",
                          headers={**server.headers, "content-type": "application/json"})
    assert response.status_code == 400
    assert "error" in response.json()


def test_api_key_is_required_on_v1(server):
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == 401
    import openai as oa

    bad = oa.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(oa.AuthenticationError):
        bad.models.list()
    # Health, version and metrics stay open, as in vLLM.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def _engine_idle(server) -> bool:
    stats = server.get("/v1/engine_stats").json()["scheduler"]
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
        stats["kv_cache_usage"] == 0.0


def _generated_tokens(server) -> float:
    for family in text_string_to_metric_families(server.get("/metrics").text):
        if family.name == "loraserve:generation_tokens":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def test_stream_disconnect_aborts_the_request(server):
    before = _generated_tokens(server)
    body = {"model": "sql", "prompt": "Once upon a time", "max_tokens": 400, "n": 4,
            "stream": True, "temperature": 0.0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break
    # Closing the connection must abort all four sequences and free their blocks.
    assert wait_until(lambda: _engine_idle(server), 10), server.output()
    assert _generated_tokens(server) - before < 4 * 400


def test_non_stream_disconnect_aborts_the_request(server):
    before = _generated_tokens(server)
    body = {"model": "poet", "prompt": "Once upon a time", "max_tokens": 400, "n": 4,
            "temperature": 0.0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                   timeout=httpx.Timeout(60, read=0.5))
    assert wait_until(lambda: _engine_idle(server), 10), server.output()
    assert _generated_tokens(server) - before < 4 * 400


def test_engine_keeps_serving_after_errors(client, expected):
    assert completion_ids(client, "sql", False) == expected[("sql", "completion")]


def test_metrics_parse_and_cover_the_issue(server, client):
    # A request to each adapter first, so the test does not lean on earlier ones.
    for model in ("sql", "poet"):
        client.completions.create(model=model, prompt=COMPLETION_PROMPT, max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in [
        "loraserve:lora_requests_info", "loraserve:num_requests_running",
        "loraserve:num_requests_waiting", "loraserve:prompt_tokens",
        "loraserve:generation_tokens", "loraserve:time_to_first_token_seconds",
        "loraserve:inter_token_latency_seconds", "loraserve:e2e_request_latency_seconds",
        "loraserve:kv_cache_usage_perc", "loraserve:lora_adapter_loaded",
    ]:
        assert name in families, name
    info = families["loraserve:lora_requests_info"].samples
    assert {s.labels["max_lora"] for s in info} == {"1"}
    latest = max(info, key=lambda s: s.value)
    assert latest.value > time.time() - 3600
    loaded = {s.labels["adapter_name"]: s.labels["level"]
              for s in families["loraserve:lora_adapter_loaded"].samples}
    assert {"sql", "poet"} <= set(loaded)
    assert sum(1 for level in loaded.values() if level == "gpu") <= 1
    ttft = [s for s in families["loraserve:time_to_first_token_seconds"].samples
            if s.name.endswith("_count")]
    assert ttft and ttft[0].value > 0


def test_n_and_several_prompts(client, expected, tokenizer):
    reference = tokenizer.decode(expected[("sql", "completion")], skip_special_tokens=True)
    response = client.completions.create(
        model="sql", prompt=[COMPLETION_PROMPT, COMPLETION_PROMPT], n=2,
        extra_body={"ignore_eos": True}, **GREEDY,
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert all(c.text == reference for c in response.choices)
    assert response.usage.completion_tokens == 4 * MAX_TOKENS
    chunks = client.chat.completions.create(
        model="poet", messages=CHAT_MESSAGES, n=2, stream=True,
        extra_body={"ignore_eos": True}, **GREEDY,
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] == tokenizer.decode(expected[("poet", "chat")],
                                                    skip_special_tokens=True)


def test_stop_string_and_echo(client, expected, tokenizer):
    full = tokenizer.decode(expected[("base", "completion")], skip_special_tokens=True)
    stop = full[len(full) // 2:][:2]
    if not stop.strip():
        pytest.skip("the reference text has no usable stop string")
    choice = client.completions.create(model="base", prompt=COMPLETION_PROMPT, stop=[stop],
                                       extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert choice.text == full[: full.index(stop)]
    echoed = client.completions.create(model="base", prompt=COMPLETION_PROMPT, echo=True,
                                       extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert echoed.text == COMPLETION_PROMPT + full


def test_runtime_lora_endpoints_are_off_by_default(server):
    response = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"})
    assert response.status_code == 404


def test_tokenize_and_detokenize(server, prompt_ids):
    chat = server.post("/tokenize", {"model": "sql", "messages": CHAT_MESSAGES}).json()
    assert chat["tokens"] == prompt_ids["chat"] and chat["count"] == len(prompt_ids["chat"])
    plain = server.post("/tokenize", {"model": "base", "prompt": COMPLETION_PROMPT}).json()
    assert plain["tokens"] == prompt_ids["completion"] and plain["max_model_len"] == 512
    text = server.post("/detokenize", {"model": "base", "tokens": plain["tokens"]}).json()
    assert text["prompt"] == COMPLETION_PROMPT
    assert server.post("/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404
    assert server.post("/tokenize", {"model": "base"}).status_code == 400
    assert server.post("/detokenize", {"tokens": [10**9]}).status_code == 400
