"""Beam search (loraserve/entrypoints/beam_search.py) over the real engine, against
a reference computed with transformers(+PEFT) in fp32 (beam_reference.py): the
same beams, in the same order, with the same cumulative logprobs, for the base
model and an adapter, with length penalties, EOS (kept or not), stop token ids,
min_tokens and early stopping; and the search stops early only where that cannot
change the answer."""

from __future__ import annotations

import asyncio

import pytest
from beam_reference import Reference

from loraserve import LLM, SamplingParams
from loraserve.entrypoints.beam_search import BeamSearchParams, beam_search
from loraserve.lora.request import LoRARequest


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=1, max_lora_rank=16)


@pytest.fixture(scope="module")
def references(llama_dir, llama_adapters) -> dict:
    return {None: Reference(llama_dir), "r8": Reference(llama_dir, llama_adapters["r8"])}


def _search(llm, prompt, params, lora=None) -> tuple[list, list[int]]:
    """The beams, and the number of beams run at each step."""
    steps: list[int] = []

    async def step(sequences, num_logprobs):
        steps.append(len(sequences))
        outs = llm.generate(
            [{"prompt_token_ids": s} for s in sequences],
            SamplingParams(max_tokens=1, temperature=0, logprobs=num_logprobs,
                           ignore_eos=True),
            lora, use_tqdm=False)
        return [sorted(o.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])
                for o in outs]

    beams = asyncio.run(beam_search(step, prompt, params, llm.tokenizer.eos_token_id,
                                    llm.tokenizer))
    return beams, steps


def _assert_same(beams, expected):
    assert [b.token_ids for b in beams] == [e.token_ids for e in expected]
    for beam, ref in zip(beams, expected, strict=True):
        assert beam.cum_logprob == pytest.approx(ref.cum_logprob, abs=2e-4)
        assert (beam.finish_reason == "stop") == ref.finished


CASES = [
    # (prompt index, adapter, params)
    (1, None, dict(beam_width=2, n=2, max_tokens=6)),
    (0, None, dict(beam_width=3, n=2, max_tokens=5, length_penalty=0.5)),
    (1, "r8", dict(beam_width=3, n=3, max_tokens=6, length_penalty=2.0)),
    (3, "r8", dict(beam_width=2, n=1, max_tokens=5, include_stop_str_in_output=True)),
    (1, None, dict(beam_width=4, n=3, max_tokens=5, ignore_eos=True)),
    (2, None, dict(beam_width=3, n=2, max_tokens=6, stop_token_ids=(18, 239))),
    (1, None, dict(beam_width=3, n=3, max_tokens=6, min_tokens=3)),
    (1, "r8", dict(beam_width=3, n=2, max_tokens=8, early_stopping=True)),
]


@pytest.mark.parametrize(("prompt_index", "lora", "kw"), CASES)
def test_beams_match_the_transformers_reference(llm, references, llama_adapters, prompts,
                                                prompt_index, lora, kw):
    prompt = prompts[prompt_index]
    lora_request = LoRARequest(lora, 1, llama_adapters[lora]) if lora else None
    params = BeamSearchParams(**kw)
    beams, _ = _search(llm, prompt, params, lora_request)
    expected = references[lora].beam_search(
        prompt, params.beam_width, params.n, params.max_tokens, llm.tokenizer.eos_token_id,
        params.length_penalty, params.ignore_eos, params.include_stop_str_in_output,
        params.stop_token_ids, params.min_tokens, params.early_stopping is True)
    _assert_same(beams, expected)
    tok = llm.tokenizer
    for beam in beams:
        text_ids = beam.token_ids
        if beam.finish_reason == "stop" and params.include_stop_str_in_output:
            text_ids = text_ids[:-1]
        assert beam.text == tok.decode(text_ids, skip_special_tokens=True)
        assert len(beam.token_ids) <= params.max_tokens
        if beam.finish_reason == "stop":
            assert beam.stop_reason in {tok.eos_token_id, *params.stop_token_ids}
            assert len(beam.token_ids) >= params.min_tokens


def test_finished_beams_are_found_and_kept_or_cut(llm, references, prompts):
    """The tiny model's EOS is likely after this prompt: finished beams compete with
    the live ones, and EOS is in token_ids only with include_stop_str_in_output."""
    eos = llm.tokenizer.eos_token_id
    cut, _ = _search(llm, prompts[1], BeamSearchParams(beam_width=3, n=3, max_tokens=4))
    kept, _ = _search(llm, prompts[1], BeamSearchParams(
        beam_width=3, n=3, max_tokens=4, include_stop_str_in_output=True))
    assert any(b.finish_reason == "stop" for b in cut)
    for a, b in zip(cut, kept, strict=True):
        assert eos not in a.token_ids
        assert b.token_ids == a.token_ids + ([eos] if a.finish_reason == "stop" else [])
        assert a.text == b.text and a.cum_logprob == b.cum_logprob


def test_the_search_stops_early_only_when_nothing_could_change(llm, references, prompts):
    """Without a length penalty a beam's score only falls: once enough beams have
    finished above every live beam, the answer is that of the full search."""
    params = BeamSearchParams(beam_width=2, n=2, max_tokens=12, length_penalty=0.0)
    beams, steps = _search(llm, prompts[1], params)
    expected = references[None].beam_search(prompts[1], 2, 2, 12,
                                            llm.tokenizer.eos_token_id, 0.0)
    _assert_same(beams, expected)
    assert len(steps) < params.max_tokens, "the search should have stopped early"


def test_stop_strings_end_beams_like_eos(llm, prompts):
    tok = llm.tokenizer
    plain, _ = _search(llm, prompts[3], BeamSearchParams(beam_width=2, n=2, max_tokens=6,
                                                         ignore_eos=True))
    text = plain[0].text
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1)
                if text[i:i + 2].isprintable() and text[i:i + 2].isascii()
                and text[i:i + 2].strip())
    for include in (False, True):
        beams, _ = _search(llm, prompts[3], BeamSearchParams(
            beam_width=2, n=2, max_tokens=6, ignore_eos=True, stop=(stop,),
            include_stop_str_in_output=include))
        stopped = [b for b in beams if b.stop_reason == stop]
        assert stopped, beams
        for beam in stopped:
            full = tok.decode(beam.token_ids)
            assert beam.finish_reason == "stop" and stop in full
            assert beam.text == full[:full.index(stop) + (len(stop) if include else 0)]
        for beam in beams:
            if beam.stop_reason != stop:
                assert stop not in beam.text
