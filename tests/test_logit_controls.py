"""logit_bias, allowed_token_ids, bad_words and min_p in the engine, as vLLM's own
tests check them (a large bias forces its token, a -100 bias removes the greedy
token, every token is an allowed one, a bad word never appears where the greedy
output had it, min_p keeps only the likely tokens), and token for token against
transformers+PEFT greedy decoding with the same change to the logits, for the
base model and adapters in one batch that mixes requests with and without them."""

from __future__ import annotations

import math

import pytest
import torch
from utils import bad_word_ids, clean_word, contains, hf_greedy

from loraserve import LLM, SamplingParams
from loraserve.lora.request import LoRARequest
from loraserve.worker.sampler import Sampler, SamplingRow

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def adapters(llama_adapters) -> dict[str, LoRARequest]:
    return {"r8": LoRARequest("r8", 1, llama_adapters["r8"]),
            "r16_qv": LoRARequest("r16_qv", 2, llama_adapters["r16_qv"])}


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                             **kw})


def _generate(llm, prompts, params, loras=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras,
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _ban_bad_words(word_ids: list[list[int]]):
    def process(logits, generated):
        for word in word_ids:
            if generated[len(generated) - len(word) + 1:] == word[:-1] \
                    and len(generated) >= len(word) - 1:
                logits[word[-1]] = float("-inf")
        return logits
    return process


def _bias(bias: dict[int, float]):
    def process(logits, _):
        for token, value in bias.items():
            logits[token] += value
        return logits
    return process


def _allow(ids: list[int]):
    def process(logits, _):
        keep = torch.full_like(logits, float("-inf"))
        keep[ids] = 0.0
        return logits + keep
    return process


def test_large_bias_forces_its_token_and_minus_100_removes_the_greedy_one(llm, prompts):
    plain = _generate(llm, [prompts[1]], _greedy())[0].token_ids
    forced = 17
    assert forced not in plain
    out = _generate(llm, [prompts[1]], _greedy(logit_bias={forced: 100.0}))[0]
    assert out.token_ids == [forced] * MAX_TOKENS
    # OpenAI's range: a bias beyond 100 is clamped, as vLLM does, not refused.
    assert SamplingParams(logit_bias={"5": 1e6, 6: -1e6}).logit_bias == {5: 100.0, 6: -100.0}
    first = plain[0]
    out = _generate(llm, [prompts[1]], _greedy(logit_bias={first: -100.0}))[0]
    assert first not in out.token_ids


def test_allowed_token_ids_are_the_only_ones_sampled(llm, prompts):
    allowed = [3, 50, 120, 200, 310]
    for params in (_greedy(allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, max_tokens=MAX_TOKENS, ignore_eos=True,
                                  seed=7, allowed_token_ids=allowed)):
        out = _generate(llm, [prompts[2]], params)[0]
        assert len(out.token_ids) == MAX_TOKENS
        assert set(out.token_ids) <= set(allowed), out.token_ids
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_never_appear_where_greedy_had_them(llm, prompts):
    tok = llm.tokenizer
    plain = _generate(llm, [prompts[3]], _greedy(max_tokens=16))[0]
    several, several_ids = clean_word(tok, plain.token_ids, 2)
    assert several in plain.text and contains(plain.token_ids, several_ids)
    out = _generate(llm, [prompts[3]], _greedy(max_tokens=16, bad_words=[several]))[0]
    assert several not in out.text and not contains(out.token_ids, several_ids)
    # Its first token alone is still allowed: only the whole word is banned.
    assert several_ids[0] in out.token_ids
    single, (single_id,) = clean_word(tok, out.token_ids, 1)
    out = _generate(llm, [prompts[3]],
                    _greedy(max_tokens=16, bad_words=[several, single]))[0]
    assert single_id not in out.token_ids and not contains(out.token_ids, several_ids)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=["  "])


def test_mixed_batch_matches_transformers_with_the_same_logit_changes(
    llm, adapters, llama_dir, llama_adapters, prompts,
):
    """Base and adapters, with and without controls, in one batch (async scheduling,
    so multi-token bad words make steps wait for the last token): each request's
    tokens are transformers+PEFT's greedy tokens with its own change to the logits."""
    _check_mixed_batch(llm, adapters, llama_dir, llama_adapters, prompts)


def _check_mixed_batch(llm, adapters, llama_dir, llama_adapters, prompts) -> None:
    tok = llm.tokenizer
    base_plain = hf_greedy(llama_dir, None, prompts[0], MAX_TOKENS)
    r8_plain = hf_greedy(llama_dir, llama_adapters["r8"], prompts[3], MAX_TOKENS)
    word, word_ids = clean_word(tok, r8_plain, 2)
    bad = [word]
    cases = [
        (prompts[0], None, {}, None),
        (prompts[0], None, {"logit_bias": {base_plain[2]: -3.0, 40: 2.5}},
         _bias({base_plain[2]: -3.0, 40: 2.5})),
        (prompts[3], "r8", {"bad_words": bad},
         _ban_bad_words(bad_word_ids(tok, bad))),
        (prompts[3], "r8", {}, None),
        (prompts[1], "r16_qv", {"allowed_token_ids": [9, 77, 150, 151, 300]},
         _allow([9, 77, 150, 151, 300])),
        (prompts[2], "r16_qv", {}, None),
        (prompts[2], None, {"logit_bias": {60: 4.0}, "allowed_token_ids": [60, 61, 62, 250]},
         lambda logits, done: _allow([60, 61, 62, 250])(_bias({60: 4.0})(logits, done), done)),
    ]
    outs = _generate(llm, [c[0] for c in cases], [_greedy(**c[2]) for c in cases],
                     [adapters[c[1]] if c[1] else None for c in cases])
    for (prompt, lora, controls, process), out in zip(cases, outs, strict=True):
        adapter_dir = llama_adapters[lora] if lora else None
        expected = hf_greedy(llama_dir, adapter_dir, prompt, MAX_TOKENS, process)
        assert out.token_ids == expected, (lora, controls)
    # The controls changed something: the bad word was in the plain output.
    assert contains(r8_plain, word_ids) and not contains(outs[2].token_ids, word_ids)
    assert outs[0].token_ids == base_plain and outs[1].token_ids != base_plain


def test_min_p_keeps_only_tokens_near_the_most_likely(llm, prompts):
    threshold = 0.3
    below_without, sampled_other = 0, 0
    greedy = _generate(llm, [prompts[1]], _greedy())[0].token_ids
    for seed in range(6):
        kw = dict(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=seed,
                  logprobs=1)
        for min_p in (threshold, 0.0):
            out = _generate(llm, [prompts[1]], SamplingParams(min_p=min_p, **kw))[0]
            for token, entry in zip(out.token_ids, out.logprobs, strict=True):
                # At temperature 1 the raw logprobs are the sampled distribution.
                too_unlikely = entry[token] < max(entry.values()) + math.log(threshold) - 1e-4
                if min_p:
                    assert not too_unlikely, (seed, token, entry)
                    sampled_other += token != max(entry, key=entry.get)
                else:
                    below_without += too_unlikely
    assert sampled_other, "min_p should still sample, not take the argmax"
    assert below_without, "without min_p some token should fall below the threshold"
    # min_p = 1 keeps only the most likely token: greedy, whatever the temperature.
    out = _generate(llm, [prompts[1]], SamplingParams(
        temperature=2.0, min_p=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3))[0]
    assert out.token_ids == greedy


def test_token_ids_outside_the_vocabulary_are_refused(llm, prompts):
    vocab = llm.config.model_config.hf_config.vocab_size
    for kw, field in ((dict(logit_bias={vocab: 1.0}), "logit_bias"),
                      (dict(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            llm.generate([{"prompt_token_ids": prompts[0]}], _greedy(**kw), use_tqdm=False)
    # The engine keeps serving.
    assert _generate(llm, [prompts[0]], _greedy())[0].token_ids


# ---- the sampler on its own ------------------------------------------------------


def _row(output=(), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0, **kw), [0], list(output), None, None)


def test_half_precision_greedy_rows_with_controls_take_their_own_fp32_argmax():
    """An all-greedy batch in bf16: rows without controls take the argmax of their
    bf16 logits as they are; rows with controls the argmax of their fp32 logits
    with the controls applied."""
    gen = torch.Generator().manual_seed(0)
    logits32 = torch.randn(4, 64, generator=gen) * 3
    logits = logits32.to(torch.bfloat16)
    top = logits32.argmax(-1).tolist()
    rows = [
        _row(),
        _row(logit_bias={5: 0.37, top[1]: -50.0}),
        _row(),
        _row(allowed_token_ids=[7, 8, 9]),
    ]
    got = Sampler(torch.device("cpu")).sample(logits, rows).to_host().token_ids
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())
    biased = logits[1].float().clone()
    biased[5] += 0.37
    biased[top[1]] -= 50.0
    assert got[1] == int(biased.argmax())
    assert got[3] == 7 + int(logits[3, 7:10].float().argmax())


def test_bad_words_ban_the_last_token_only_after_the_rest():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    # 3 is always banned; 4 only right after 1, or after 3, 2.
    words = [[1, 4], [3, 2, 4], [3]]
    cases = [([], 4), ([1], 2), ([3, 2], 2), ([0, 3], 4), ([2, 1], 2), ([1, 2], 4)]
    for output, expected in cases:
        params = SamplingParams(temperature=0)
        params.bad_words_token_ids = words
        row = SamplingRow(params, [0], list(output), None, None)
        got = sampler.sample(logits.clone(), [row]).to_host().token_ids[0]
        assert got == expected, output
    assert params.reads_output_tokens
    one_token = SamplingParams(temperature=0)
    one_token.bad_words_token_ids = [[3], [1]]
    assert one_token.has_logit_controls and not one_token.reads_output_tokens


def test_controls_never_take_the_decode_graph_argmax():
    plain = [_row(), _row(max_tokens=3)]
    assert Sampler.argmax_suffices(plain)
    for kw in (dict(logit_bias={1: 1.0}), dict(allowed_token_ids=[1])):
        assert not Sampler.argmax_suffices(plain + [_row(**kw)]), kw
    bad = SamplingParams(temperature=0)
    bad.bad_words_token_ids = [[3]]
    assert not Sampler.argmax_suffices(plain + [SamplingRow(bad, [0], [], None, None)])


# ---- on a GPU: decode steps replay CUDA graphs, whose fused argmax the controls
# must not take -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_mixed_batch_on_a_gpu_with_decode_graphs(adapters, llama_dir, llama_adapters,
                                                 prompts, async_scheduling):
    llm = LLM(llama_dir, device="cuda", dtype="float32", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_seqs=16, kv_cache_memory_bytes=1 << 28,
              async_scheduling=async_scheduling)
    assert llm.engine.executor.driver.graphs is not None
    _check_mixed_batch(llm, adapters, llama_dir, llama_adapters, prompts)


@pytest.mark.gpu
def test_bf16_controls_hold_in_decode_graph_steps(adapters, llama_dir, prompts):
    llm = LLM(llama_dir, device="cuda", dtype="bfloat16", enable_lora=True, max_loras=2,
              max_lora_rank=16, max_num_seqs=16, kv_cache_memory_bytes=1 << 28)
    assert llm.engine.executor.driver.graphs is not None
    alone = _generate(llm, [prompts[1]], _greedy(), [adapters["r8"]])[0].token_ids
    allowed = [9, 77, 150, 300]
    outs = _generate(
        llm, [prompts[1]] * 4,
        [_greedy(), _greedy(logit_bias={17: 100.0}), _greedy(allowed_token_ids=allowed),
         _greedy(logit_bias={alone[0]: -100.0})],
        [adapters["r8"], None, adapters["r8"], adapters["r8"]])
    assert outs[0].token_ids == alone
    assert outs[1].token_ids == [17] * MAX_TOKENS
    assert set(outs[2].token_ids) <= set(allowed)
    assert outs[3].token_ids[0] != alone[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_sampler_applies_controls_on_cuda_as_on_the_cpu(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 32000, generator=gen) * 4).to(dtype)
    top = logits.float().argmax(-1).tolist()
    bad = SamplingParams(temperature=0)
    bad.bad_words_token_ids = [[top[3]], [5, top[4]]]
    rows = [_row(), _row(logit_bias={7: 30.0, top[1]: -100.0}), _row(),
            SamplingRow(bad, [0], [9, 5], None, None), _row(allowed_token_ids=[11, 12, 13]),
            _row(logit_bias={top[5]: -0.001})]
    on_cpu = Sampler(torch.device("cpu")).sample(logits, rows).to_host().token_ids
    on_gpu = Sampler(torch.device("cuda")).sample(logits.cuda(), rows).to_host().token_ids
    assert on_gpu == on_cpu
    assert on_cpu[1] == 7 and on_cpu[3] != top[3] and on_cpu[4] in (11, 12, 13)
