"""Tokenizer and chat template, through transformers."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from loraserve.config import EngineConfig


def load_tokenizer(
    source: str | EngineConfig, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """The tokenizer of a folder, or of a config (with the config's trust_remote_code)."""
    if isinstance(source, EngineConfig):
        path = source.model_config.tokenizer
        trust_remote_code = source.model_config.trust_remote_code
    else:
        path = source
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def eos_token_id(tokenizer: PreTrainedTokenizerBase, hf_config=None) -> int | None:
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    eos = getattr(hf_config, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
