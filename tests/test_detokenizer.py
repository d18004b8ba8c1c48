"""Incremental detokenization gives the same text as decoding everything at once."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from loraserve.engine.detokenizer import IncrementalDetokenizer, _backend_decoder


@pytest.mark.parametrize("clean_up", [False, True])
def test_incremental_text_equals_full_decode(llama_dir, clean_up):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    # Without the clean-up pass the Rust decoder is called directly; with it,
    # transformers' decode.
    tok.clean_up_tokenization_spaces = clean_up
    assert (_backend_decoder(tok) is None) == clean_up
    rng = random.Random(0)
    text = "Paged attention keeps the key value cache: héllo wörld ✓ 1 2 3. "
    ids = tok(text * 3).input_ids
    for trial in range(5):
        prompt = ids[: rng.randrange(0, 10)]
        # Random ids too, which may split multi-byte characters across tokens.
        output = ids[:40] if trial == 0 else [rng.randrange(len(tok)) for _ in range(40)]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
        pos = 0
        while pos < len(output):
            step = rng.randrange(1, 4)
            chunk = output[pos:pos + step]
            pos += step
            partial = detok.add(chunk, final=pos >= len(output))
            assert "\ufffd" not in partial[-1:] or pos >= len(output)
        assert detok.text == tok.decode(output, skip_special_tokens=True)
