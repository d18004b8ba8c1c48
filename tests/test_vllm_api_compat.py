"""The OpenAI and LoRA endpoints answer as vLLM's do, so that a vLLM user can switch
by changing the command name: adapter load/unload errors (status, error type,
wording), the model cards, logprobs=0, non-finite logprobs as vLLM's -9999.0,
continuous usage stats, and a 400 naming every vLLM request field that loraserve
does not implement."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from serve_utils import ServerProcess
from utils import hf_greedy

PROMPT = "The quick brown fox"
MAX_TOKENS = 5
CHAT = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with a tokenizer that starts every text with a BOS token, so
    that add_special_tokens makes a difference."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    out = tmp_path_factory.mktemp("bos_model") / "llama"
    shutil.copytree(llama_dir, out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = "<|im_start|>"
    tok.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tok.token_to_id(bos))],
    )
    tok.save(str(out / "tokenizer.json"))
    return str(out)


@pytest.fixture(scope="module")
def server(model_dir, llama_adapters):
    with ServerProcess(
        [
            model_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "16", "--lora-modules", f"a8={llama_adapters['r8']}",
        ],
        env={"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def prompt_ids(llama_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)(PROMPT).input_ids


def error_of(response) -> dict:
    return response.json()["error"]


# ---- /v1/load_lora_adapter and /v1/unload_lora_adapter ----------------------------


def test_load_of_a_missing_path_is_404(server, tmp_path):
    missing = tmp_path / "not" / "an" / "adapter"
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "notfound", "lora_path": str(missing)})
    assert response.status_code == 404, response.text
    error = error_of(response)
    assert error["type"] == "NotFoundError"
    assert f"No adapter found for {missing}" in error["message"]


def test_load_of_a_directory_without_adapter_config_is_404(server, tmp_path):
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "empty", "lora_path": str(tmp_path)})
    assert response.status_code == 404, response.text
    assert "No adapter found" in error_of(response)["message"]


def test_load_of_invalid_json_is_400(server, tmp_path):
    (tmp_path / "adapter_config.json").write_text("this is not json")
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "badjson", "lora_path": str(tmp_path)})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "BadRequestError"
    assert "not valid JSON" in error["message"]


@pytest.mark.parametrize("config", ['[{"r": 8, "lora_alpha": 16}]', '"LORA"', "8"])
def test_load_of_a_config_that_is_no_json_object_is_400(server, tmp_path, llama_adapters,
                                                        config):
    adapter = tmp_path / "notobject"
    shutil.copytree(llama_adapters["r8"], adapter)
    (adapter / "adapter_config.json").write_text(config)
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "notobject", "lora_path": str(adapter)})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "BadRequestError"
    assert "adapter_config.json must hold a JSON object" in error["message"]


@pytest.mark.parametrize(("case", "config_change", "expected"), [
    ("rank", {"r": 1024}, "is greater than max_lora_rank"),
    ("dora", {"use_dora": True}, "does not yet support DoRA"),
    ("modules_to_save", {"modules_to_save": ["lm_head"]},
     "only supports modules_to_save being None"),
    ("bias", {"bias": "all"}, "Adapter bias cannot be used"),
    ("alpha", {"lora_alpha": 1e38}, "check lora_alpha in adapter_config.json"),
])
def test_load_of_an_adapter_loraserve_cannot_serve_is_400(
    server, tmp_path, llama_adapters, case, config_change, expected
):
    adapter = tmp_path / case
    shutil.copytree(llama_adapters["r8"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config.update(config_change)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    response = server.post("/v1/load_lora_adapter", {"lora_name": case, "lora_path": str(adapter)})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "BadRequestError"
    assert expected in error["message"]
    assert case not in {m["id"] for m in server.get("/v1/models").json()["data"]}


def test_load_of_wrongly_shaped_tensors_is_400(server, tmp_path, llama_adapters):
    from safetensors.torch import load_file, save_file

    adapter = tmp_path / "narrow"
    shutil.copytree(llama_adapters["r8"], adapter)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()  # one input column short
    save_file(tensors, weights)
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "narrow", "lora_path": str(adapter)})
    assert response.status_code == 400, response.text
    assert error_of(response)["type"] == "BadRequestError"
    assert "shape" in error_of(response)["message"]


def test_load_of_an_already_loaded_name_is_invalid_user_input(server, llama_adapters):
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "a8", "lora_path": llama_adapters["r1"]})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "InvalidUserInput"
    assert error["message"] == (
        "The lora adapter 'a8' has already been loaded. If you want to load the adapter in "
        "place, set 'load_inplace' to True."
    )


def test_load_without_a_path_is_invalid_user_input(server):
    response = server.post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": " "})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["type"] == "InvalidUserInput"
    assert error["message"] == "Both 'lora_name' and 'lora_path' must be provided."


def test_unload_of_an_unknown_name_is_404(server):
    response = server.post("/v1/unload_lora_adapter", {"lora_name": "never-loaded"})
    assert response.status_code == 404, response.text
    error = error_of(response)
    assert error["type"] == "NotFoundError"
    assert error["message"] == "The lora adapter 'never-loaded' cannot be found."


# ---- /v1/models and /v1/models/{id} ------------------------------------------------


def test_model_cards(client, model_dir, llama_adapters):
    cards = {card.id: card for card in client.models.list().data}
    assert cards["base"].root == model_dir
    assert cards["a8"].root == llama_adapters["r8"]
    assert cards["a8"].parent == "base"
    base = client.models.retrieve("base")
    assert (base.id, base.root, base.parent) == ("base", model_dir, None)
    adapter = client.models.retrieve("a8")
    assert (adapter.id, adapter.root, adapter.parent) == ("a8", llama_adapters["r8"], "base")


def test_retrieve_of_an_unknown_model_is_404(server, client):
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    error = error_of(server.get("/v1/models/no-such-model"))
    assert error["message"] == "The model `no-such-model` does not exist."


def test_retrieve_finds_a_runtime_loaded_adapter(server, client, llama_adapters):
    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "org/rt", "lora_path": llama_adapters["r1"]})
    assert response.status_code == 200, response.text
    card = client.models.retrieve("org/rt")
    assert (card.root, card.parent) == (llama_adapters["r1"], "base")
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "org/rt"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/rt")


def test_unknown_model_in_completions_and_chat_does_not_exist(client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist."):
        client.chat.completions.create(model="nope", messages=CHAT, max_tokens=1)


# ---- request fields ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["base", "a8"])
def test_zero_logprobs_give_the_chosen_token(client, llama_dir, llama_adapters, prompt_ids,
                                             model):
    completion = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0,
        logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    logprobs = completion.choices[0].logprobs
    ids = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
    adapter = llama_adapters["r8"] if model == "a8" else None
    assert ids == hf_greedy(llama_dir, adapter, prompt_ids, MAX_TOKENS)
    assert len(logprobs.token_logprobs) == MAX_TOKENS
    assert all(lp is not None and lp <= 0.0 for lp in logprobs.token_logprobs)
    # logprobs=0: the chosen token alone, with its own logprob.
    assert [list(top) for top in logprobs.top_logprobs] == [[t] for t in logprobs.tokens]
    assert [top[t] for top, t in zip(logprobs.top_logprobs, logprobs.tokens, strict=True)] \
        == logprobs.token_logprobs


def test_some_logprobs_give_the_chosen_token_and_the_top_k(client, prompt_ids):
    completion = client.completions.create(
        model="base", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5,
        # As ids: two ids of the tiny tokenizer may decode to the same text.
        extra_body={"return_tokens_as_token_ids": True},
    )
    logprobs = completion.choices[0].logprobs
    assert all(5 <= len(top) <= 6 for top in logprobs.top_logprobs)
    for top, token in zip(logprobs.top_logprobs, logprobs.tokens, strict=True):
        assert token in top


@pytest.fixture(scope="module")
def nan_server(llama_dir, tmp_path_factory):
    """The tiny Llama with NaN in one lm_head row: every logit, so every logprob,
    is NaN, as with a broken model or adapter."""
    import torch
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("nan_model") / "llama"
    shutil.copytree(llama_dir, out)
    weights = load_file(out / "model.safetensors")
    weights["lm_head.weight"][7] = torch.nan
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with ServerProcess([str(out), "--served-model-name", "base"]) as srv:
        yield srv


def _strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def _logprob_values(value) -> list[float]:
    """Every logprob in a response or chunk: chat's and prompt_logprobs' "logprob"
    fields, completions' token_logprobs and their top_logprobs maps."""
    found = []
    if isinstance(value, list):
        for item in value:
            found += _logprob_values(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key == "logprob":
                found.append(item)
            elif key == "token_logprobs":
                found += [lp for lp in item if lp is not None]
            elif key == "top_logprobs" and item and "token" not in (item[0] or {}):
                found += [lp for entry in item if entry for lp in entry.values()]
            else:
                found += _logprob_values(item)
    return found


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "echo": True, "prompt_logprobs": 1}),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2,
                              "stream": True}),
], ids=["completion", "completion-stream", "chat", "chat-stream"])
def test_non_finite_logprobs_go_out_as_vllms_floor(nan_server, path, body):
    """NaN (or -inf) logprobs are not JSON: they are answered as -9999.0, vLLM's
    floor, where they used to give a 500 (or invalid NaN in an SSE event)."""
    response = nan_server.post(path, {"model": "base", "max_tokens": 3, **body})
    assert response.status_code == 200, response.text
    if body.get("stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines()
                  if line.startswith("data: {")]
        parsed = [_strict_json(event) for event in events]
    else:
        parsed = [_strict_json(response.text)]
    values = _logprob_values(parsed)
    assert values and set(values) == {-9999.0}, values


def test_continuous_usage_stats_in_every_completion_chunk(client, prompt_ids):
    stream = client.completions.create(
        model="base", prompt=prompt_ids, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    token_chunks = chunks[:-1]
    assert token_chunks and all(c.usage is not None for c in token_chunks)
    counts = [c.usage.completion_tokens for c in token_chunks]
    assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
    assert all(c.usage.prompt_tokens == len(prompt_ids) for c in token_chunks)
    assert all(c.usage.total_tokens == len(prompt_ids) + c.usage.completion_tokens
               for c in token_chunks)


def test_continuous_usage_stats_in_every_chat_chunk(client):
    stream = client.chat.completions.create(
        model="base", messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert all(c.usage is not None for c in chunks)
    assert chunks[0].usage.completion_tokens == 0  # the role chunk
    assert chunks[-2].usage.completion_tokens == MAX_TOKENS


def test_continuous_usage_stats_need_include_usage(client, prompt_ids):
    stream = client.completions.create(
        model="base", prompt=prompt_ids, max_tokens=2, stream=True,
        stream_options={"continuous_usage_stats": True},
    )
    assert all(c.usage is None for c in stream)


def test_add_special_tokens(server, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    with_bos = len(tok(PROMPT).input_ids)
    assert len(tok(PROMPT, add_special_tokens=False).input_ids) == with_bos - 1

    def prompt_tokens(endpoint: str, body: dict) -> int:
        response = server.post(f"/v1/{endpoint}", {"model": "base", "max_tokens": 1, **body})
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("completions", {"prompt": PROMPT}) == with_bos
    assert prompt_tokens("completions", {"prompt": PROMPT, "add_special_tokens": False}) \
        == with_bos - 1
    # Chat: the template brings its own special tokens; True adds the tokenizer's.
    plain = prompt_tokens("chat/completions", {"messages": CHAT})
    assert prompt_tokens("chat/completions", {"messages": CHAT, "add_special_tokens": True}) \
        == plain + 1


@pytest.mark.parametrize(("endpoint", "field", "value"), [
    ("chat/completions", "prompt_logprobs", 1),
    ("completions", "truncate_prompt_tokens", 3),
    ("completions", "spaces_between_special_tokens", False),
    ("completions", "structural_tag", '{"structures": []}'),
    ("completions", "priority", 1),
    ("completions", "request_id", "mine"),
    ("completions", "cache_salt", "salt"),
    ("chat/completions", "echo", True),
    ("chat/completions", "best_of", 2),
    ("chat/completions", "reasoning_effort", "low"),
])
def test_unsupported_fields_are_refused_by_name(server, endpoint, field, value):
    body = {"model": "base", "max_tokens": 1, field: value}
    body.update({"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT})
    response = server.post(f"/v1/{endpoint}", body)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["param"] == field
    assert field in error["message"]


def test_tool_choice_none_is_accepted(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = server.post("/v1/chat/completions", {
        "model": "base", "messages": CHAT, "max_tokens": 1, "tools": [tool],
        "tool_choice": "none",
    })
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("choice", [{"tool_choice": "auto"}, {}])
def test_auto_tool_choice_without_a_parser_is_vllms_400(server, choice):
    """Without --enable-auto-tool-choice vLLM refuses "auto", which is also what a
    request with tools and no tool_choice asks for."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = server.post("/v1/chat/completions", {
        "model": "base", "messages": CHAT, "max_tokens": 1, "tools": [tool], **choice})
    assert response.status_code == 400, response.text
    assert error_of(response)["message"] == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')


@pytest.mark.parametrize(("field", "value"), [
    ("use_beam_search", False), ("length_penalty", 1.0), ("priority", 0),
    ("spaces_between_special_tokens", True), ("bad_words", []), ("prompt_logprobs", None),
])
def test_unsupported_fields_at_their_defaults_are_accepted(server, field, value):
    response = server.post("/v1/completions",
                           {"model": "base", "prompt": PROMPT, "max_tokens": 1, field: value})
    assert response.status_code == 200, response.text
