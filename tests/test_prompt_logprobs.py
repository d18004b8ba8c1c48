"""Prompt logprobs (SamplingParams.prompt_logprobs) against a plain transformers
(+PEFT) forward pass in fp32: the logprob and rank of every prompt token after the
first and the top-k alternatives, also when the prompt is chunked over several
steps, with async scheduling on and off, next to requests that do not ask."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
import torch

from loraserve import LLM, LoRARequest, SamplingParams

K = 3
TOL = 1e-4


def hf_prompt_logprobs(model_dir, adapter_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i holds the logprobs predicting prompt[i + 1]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against(reference: torch.Tensor, prompt: list[int], got, k: int = K) -> None:
    assert len(got) == len(prompt)
    assert got[0] is None
    for i, position in enumerate(got[1:]):
        row = reference[i]
        token = prompt[i + 1]
        entries = list(position.items())
        # The prompt token first, with its logprob and rank.
        assert entries[0][0] == token
        assert entries[0][1].logprob == pytest.approx(float(row[token]), abs=TOL)
        assert entries[0][1].rank == int((row >= row[token]).sum())
        # Then the top k, most likely first (the prompt token may be among them).
        top = torch.topk(row, k)
        want = {int(t): float(v) for t, v in zip(top.indices, top.values, strict=True)}
        got_top = {t: lp.logprob for t, lp in entries if t != token or lp.rank <= k}
        assert set(got_top) == set(want)
        for t, v in want.items():
            assert got_top[t] == pytest.approx(v, abs=TOL)
        ranks = [lp.rank for t, lp in entries[1:]]
        assert ranks == sorted(ranks) and all(r <= k for r in ranks)


@pytest.fixture(scope="module")
def long_prompt(llama_dir) -> list[int]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(4, 300, (45,), generator=gen).tolist()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_match_transformers_chunked_and_mixed(
    llama_dir, llama_adapters, prompts, long_prompt, async_scheduling
):
    r8 = LoRARequest("r8", 1, llama_adapters["r8"])
    kwargs = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                  max_num_batched_tokens=16, async_scheduling=async_scheduling,
                  enable_prefix_caching=False)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    asks = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=K)
    others = [{"prompt_token_ids": p} for p in prompts[:2]]

    batch = [*others, {"prompt_token_ids": long_prompt}, {"prompt_token_ids": long_prompt},
             {"prompt_token_ids": prompts[3]}]
    loras = [None, r8, None, r8, r8]
    # The same batch with no prompt logprobs asked: the same steps (no prefix caching,
    # which a request for prompt logprobs bypasses), so every output is bit for bit
    # the same.
    without = LLM(llama_dir, **kwargs).generate(
        batch, [plain, plain, *[msgspec.structs.replace(asks, prompt_logprobs=None)] * 3],
        loras, use_tqdm=False)
    outs = LLM(llama_dir, **kwargs).generate(batch, [plain, plain, asks, asks, asks], loras,
                                             use_tqdm=False)
    for a, b in zip(without, outs, strict=True):
        assert a.prompt_logprobs is None
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == a.outputs[0].logprobs
    assert outs[0].prompt_logprobs is None and outs[1].prompt_logprobs is None
    # 45 tokens in steps of at most 16: the prompt spans several steps.
    check_against(hf_prompt_logprobs(llama_dir, None, long_prompt), long_prompt,
                  outs[2].prompt_logprobs)
    with_r8 = hf_prompt_logprobs(llama_dir, llama_adapters["r8"], long_prompt)
    check_against(with_r8, long_prompt, outs[3].prompt_logprobs)
    check_against(hf_prompt_logprobs(llama_dir, llama_adapters["r8"], prompts[3]), prompts[3],
                  outs[4].prompt_logprobs)
    # The adapter changes them: the check above could tell them apart.
    base_first = outs[2].prompt_logprobs[1][long_prompt[1]].logprob
    assert base_first != pytest.approx(outs[3].prompt_logprobs[1][long_prompt[1]].logprob,
                                       abs=10 * TOL)
    # The generated tokens are those of transformers' greedy decoding.
    from utils import hf_greedy

    assert outs[2].outputs[0].token_ids == hf_greedy(llama_dir, None, long_prompt, 4)


def test_prompt_logprobs_zero_n_and_one_token_prompt(llama_dir, prompts):
    llm = LLM(llama_dir, dtype="float32")
    outs = llm.generate(
        [{"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[1][:1]}],
        [SamplingParams(temperature=0.7, seed=1, n=2, max_tokens=3, prompt_logprobs=0),
         SamplingParams(max_tokens=2, prompt_logprobs=2)],
        use_tqdm=False,
    )
    ref = hf_prompt_logprobs(llama_dir, None, prompts[1])
    got = outs[0].prompt_logprobs
    assert len(got) == len(prompts[1]) and got[0] is None
    for i, position in enumerate(got[1:]):
        # k = 0: the prompt token alone.
        ((token, lp),) = position.items()
        assert token == prompts[1][i + 1]
        assert lp.logprob == pytest.approx(float(ref[i][token]), abs=TOL)
    assert len(outs[0].outputs) == 2
    assert outs[1].prompt_logprobs == [None]


def test_prompt_logprobs_after_preemption_are_sent_once(llama_dir, long_prompt):
    # A KV cache too small for both requests: one is preempted and recomputed.
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=7, block_size=8,
              max_num_batched_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": long_prompt}] * 2, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    ref = hf_prompt_logprobs(llama_dir, None, long_prompt)
    for out in outs:
        check_against(ref, long_prompt, out.prompt_logprobs, k=1)


# ---- /v1/completions -----------------------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir):
    from serve_utils import ServerProcess

    with ServerProcess([llama_dir, "--served-model-name", "base", "--dtype", "float32"]) as srv:
        yield srv


def test_completions_prompt_logprobs_and_echo_with_logprobs(server, llama_dir, prompts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llama_dir)
    ids = prompts[2]
    offline = LLM(llama_dir, dtype="float32").generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2,
                       logprobs=2), use_tqdm=False)[0]
    body = {"model": "base", "prompt": ids, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}

    response = server.post("/v1/completions", {**body, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    got = choice["prompt_logprobs"]
    assert choice["logprobs"] is None
    assert len(got) == len(ids) and got[0] is None
    for token_id, position, want in zip(ids[1:], got[1:], offline.prompt_logprobs[1:],
                                        strict=True):
        assert next(iter(position)) == str(token_id)
        assert set(position) == {str(t) for t in want}
        for t, lp in want.items():
            entry = position[str(t)]
            assert entry["logprob"] == pytest.approx(lp.logprob, abs=TOL)
            assert entry["rank"] == lp.rank
            assert entry["decoded_token"] == tok.decode([t])

    response = server.post("/v1/completions", {**body, "echo": True, "logprobs": 2})
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    prompt_text = tok.decode(ids)
    assert choice["text"] == prompt_text + tok.decode(offline.outputs[0].token_ids)
    assert choice.get("prompt_logprobs") is None
    lps = choice["logprobs"]
    n = len(ids)
    assert lps["tokens"] == [tok.decode([t]) for t in ids + offline.outputs[0].token_ids]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, n):
        want = offline.prompt_logprobs[i]
        assert lps["token_logprobs"][i] == pytest.approx(want[ids[i]].logprob, abs=TOL)
        assert lps["top_logprobs"][i] == pytest.approx(
            {tok.decode([t]): lp.logprob for t, lp in want.items()}, abs=TOL)
    for j, (token_id, want) in enumerate(zip(offline.outputs[0].token_ids,
                                             offline.outputs[0].logprobs, strict=True)):
        assert lps["token_logprobs"][n + j] == pytest.approx(want[token_id], abs=TOL)
    token_lens = [len(tok.decode([t])) for t in ids]
    assert lps["text_offset"][:n] == [sum(token_lens[:i]) for i in range(n)]
    assert lps["text_offset"][n] == len(prompt_text)

    # Streamed, the prompt's logprobs come in the first chunk.
    tokens: list[str] = []
    token_logprobs: list = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "echo": True, "logprobs": 2, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))["choices"][0]
                tokens += chunk["logprobs"]["tokens"]
                token_logprobs += chunk["logprobs"]["token_logprobs"]
    assert tokens == lps["tokens"]
    assert token_logprobs == pytest.approx(lps["token_logprobs"], abs=TOL)


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_completions_bad_prompt_logprobs_are_400(server, extra, param):
    response = server.post("/v1/completions",
                           {"model": "base", "prompt": "Hello", "max_tokens": 1, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
