"""Sampling parameters: seeds, top-k/top-p/min-p, penalties, stops, n, logprobs."""

from __future__ import annotations

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.worker.sampler import Sampler, SamplingRow


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir)


def _gen(llm, prompt, **kw):
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**kw))
    return out.outputs


def test_seed_is_reproducible_whatever_the_batch(llm, prompts):
    kw = dict(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = _gen(llm, prompts[0], **kw)[0].token_ids
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in [prompts[1], prompts[0], prompts[2]]],
        [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
         SamplingParams(**kw), SamplingParams(temperature=0.7, max_tokens=5)],
    )
    assert batch[1].outputs[0].token_ids == alone
    other = _gen(llm, prompts[0], **{**kw, "seed": 99})[0].token_ids
    assert other != alone


def test_top_k_one_is_greedy(llm, prompts):
    greedy = _gen(llm, prompts[2], temperature=0, max_tokens=8, ignore_eos=True)[0]
    top1 = _gen(llm, prompts[2], temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True)[0]
    assert top1.token_ids == greedy.token_ids


def test_max_tokens_stop_token_ids_and_eos(llm, prompts):
    greedy = _gen(llm, prompts[0], temperature=0, max_tokens=10, ignore_eos=True)[0]
    assert len(greedy.token_ids) == 10 and greedy.finish_reason == "length"
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    stopped = _gen(llm, prompts[0], temperature=0, max_tokens=10, ignore_eos=True,
                   stop_token_ids=[stop_at])[0]
    assert stopped.token_ids == greedy.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    # The same token as EOS ends the request unless ignore_eos.
    (out,) = llm.generate([{"prompt_token_ids": prompts[0]}],
                          SamplingParams(temperature=0, max_tokens=10))
    eos = llm.tokenizer.eos_token_id
    if eos in greedy.token_ids:
        assert out.outputs[0].token_ids == greedy.token_ids[: greedy.token_ids.index(eos) + 1]
    else:
        assert out.outputs[0].token_ids == greedy.token_ids


def test_min_tokens_holds_back_stop_tokens(llm, prompts):
    greedy = _gen(llm, prompts[0], temperature=0, max_tokens=10, ignore_eos=True)[0]
    stop_at = greedy.token_ids[0]
    out = _gen(llm, prompts[0], temperature=0, max_tokens=10, stop_token_ids=[stop_at],
               min_tokens=3, ignore_eos=True)[0]
    assert len(out.token_ids) >= 3
    assert stop_at not in out.token_ids[:2]


def test_stop_strings_cut_the_text(llm, prompts):
    full = _gen(llm, prompts[1], temperature=0, max_tokens=16, ignore_eos=True)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    cut = _gen(llm, prompts[1], temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])[0]
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = _gen(llm, prompts[1], temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                include_stop_str_in_output=True)[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_n_samples(llm, prompts):
    outs = _gen(llm, prompts[0], n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) > 1
    again = _gen(llm, prompts[0], n=3, temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_logprobs_match_transformers(llm, llama_dir, prompts):
    from transformers import AutoModelForCausalLM

    out = _gen(llm, prompts[0], temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)[0]
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    ids = torch.tensor([prompts[0] + out.token_ids])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)
    base = len(prompts[0]) - 1
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert entry[token] == pytest.approx(float(ref[base + i, token]), abs=1e-4)
        top = torch.topk(ref[base + i], 3).indices.tolist()
        assert set(top) <= set(entry)
    assert out.cumulative_logprob == pytest.approx(
        sum(out.logprobs[i][t] for i, t in enumerate(out.token_ids)), abs=1e-5)


def _row(**kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), prompt_token_ids=kw.pop("prompt", [0]),
                       output_token_ids=[], eos_token_id=None, generator=None)


def test_penalties_follow_their_definitions():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9]])
    # Repetition penalty divides positive and multiplies negative logits of seen tokens.
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [1],
                      None, None)
    assert sampler.sample(logits, [row]).to_host().token_ids == [3]  # 2.0/2 = 1.0 < 1.9
    # Frequency penalty counts repeats in the output; presence penalty is once.
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.2), [], [0, 0],
                      None, None)
    assert sampler.sample(logits, [row]).to_host().token_ids == [3]  # 2.0 - 0.4 < 1.9
    row = SamplingRow(SamplingParams(temperature=0, presence_penalty=0.05), [], [0, 0],
                      None, None)
    assert sampler.sample(logits, [row]).to_host().token_ids == [0]  # 2.0 - 0.05 > 1.9


def test_argmax_suffices_only_where_sample_is_the_plain_argmax():
    # A decode graph takes the argmax itself; its ids stand for sample()'s only
    # for plain greedy rows.
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.9], [0.1, 0.3, -2.0, 0.2]])
    plain = [_row(temperature=0), _row(temperature=0, max_tokens=3)]
    assert Sampler.argmax_suffices(plain)
    expected = sampler.sample(logits, plain).to_host()
    assert Sampler.from_argmax(logits.argmax(dim=-1)).to_host() == expected
    # min_tokens holds back EOS (id 0 here), the argmax of the first row.
    held = SamplingRow(SamplingParams(temperature=0, min_tokens=2), [0], [], 0, None)
    assert sampler.sample(logits[:1], [held]).to_host().token_ids == [3]
    assert not Sampler.argmax_suffices([held])
    for kw in (dict(temperature=1.0), dict(temperature=0, logprobs=1),
               dict(temperature=0, presence_penalty=0.5)):
        assert not Sampler.argmax_suffices(plain + [_row(**kw)]), kw


def test_top_p_and_min_p_remove_the_tail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    for kw, allowed in [(dict(top_p=0.6), {0, 1}), (dict(min_p=0.5), {0, 1}),
                        (dict(top_k=3), {0, 1, 2})]:
        seen = set()
        for seed in range(200):
            sampler = Sampler(torch.device("cpu"), seed=seed)
            seen |= set(sampler.sample(logits, [_row(temperature=1.0, **kw)]).to_host().token_ids)
        assert seen == allowed, kw


def test_invalid_sampling_params_are_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
