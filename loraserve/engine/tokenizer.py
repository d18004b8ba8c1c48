"""Tokenizer and chat template, through transformers."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from loraserve.config import EngineConfig


def load_tokenizer(source: str | EngineConfig) -> PreTrainedTokenizerBase:
    path = source.model_config.tokenizer if isinstance(source, EngineConfig) else source
    return AutoTokenizer.from_pretrained(path)


def eos_token_id(tokenizer: PreTrainedTokenizerBase, hf_config=None) -> int | None:
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
