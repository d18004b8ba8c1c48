"""Incremental detokenization: the text of a growing list of token ids, decoding
only a short window per step instead of the whole output every time."""

from __future__ import annotations

# Prompt tokens kept as context for the first output tokens: tokenizers that
# drop a word's leading space when it starts the decoded text (SentencePiece)
# need a token before it.
_CONTEXT_TOKENS = 5


def _backend_decoder(tokenizer):
    """The Rust tokenizer's decode when it gives what `tokenizer.decode` gives (a
    fast tokenizer without the clean-up pass), else None. transformers' Python
    wrapper costs more than the decoding itself: ~13 us a call, two calls per
    request per step. (Not decode_batch: it hands two short lists to a thread pool.)"""
    from transformers import PreTrainedTokenizerFast

    if isinstance(tokenizer, PreTrainedTokenizerFast) and not getattr(
            tokenizer, "clean_up_tokenization_spaces", False):
        return tokenizer.backend_tokenizer.decode
    return None


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend_decode = _backend_decoder(tokenizer)
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] was decoded already; ids[read:] is not in `text` yet.
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int], final: bool = False) -> str:
        """Append tokens; return the whole output text so far. A trailing partial
        UTF-8 character is held back until the tokens that complete it arrive (or
        the output ends)."""
        self.ids.extend(new_token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        return self.text
