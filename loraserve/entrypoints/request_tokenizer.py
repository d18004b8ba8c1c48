"""The tokenizer as request handlers use it: off the event loop, and with a cheap
check that refuses a prompt text certainly too long before anyone tokenizes it.

Tokenizing or rendering a chat template takes time that grows with the request
(a 16 MB prompt: tens of seconds and gigabytes on a small CPU), so it runs on a
worker thread while the event loop keeps serving everyone else, /health included.
Fast tokenizers release the GIL while they encode. Two threads: one for small
work, one for large work (a long text, a template from the request), so that a
large request never delays the small ones, and only one large request holds
memory at a time.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

# NFC composes up to three UTF-8 bytes of input into one (Hangul jamo into a
# syllable, a letter and two combining marks into one code point): checked over
# every code point, the output is never shorter than a third of the input.
_NFC_MAX_SHRINK = 3
# Work on more characters than this (text to tokenize or render, ids to decode at
# about 4 characters each) goes to the worker for large work: a few milliseconds
# of tokenizing below it.
LARGE_WORK_CHARS = 1 << 16
# Where no bound holds, a text longer than this many characters for each token it may
# have is refused without tokenizing it. Prose averages about 4 characters a token,
# code and runs of whitespace a few more: 32 is far beyond what a real prompt needs,
# and keeps the work of one request in proportion to the context.
MAX_CHARS_PER_TOKEN = 32
# Pre-tokenizers that keep every byte of their input in some piece ("Removed"
# would drop the matches).
_KEEPING_SPLIT_BEHAVIOURS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


class DaemonWorker(Executor):
    """Runs submitted calls one after another on a single daemon thread.

    A daemon, unlike ThreadPoolExecutor's workers, which the interpreter joins at
    exit: a chat template that loops for minutes must not hold the server past its
    shutdown."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        self._calls.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._calls.put(None)
        if wait:
            self._thread.join()

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it started
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)


@dataclass(frozen=True)
class TokenCountBound:
    """A lower bound on the token count of any text, from its UTF-8 length.

    Every byte of the text lands in some token except the bytes whose byte-level
    symbol is missing from the vocabulary (a BPE without an unknown token skips
    them; they are counted out); the normalizer shrinks the rest at most `shrink`
    times; one token covers at most `bytes_per_token` bytes."""

    bytes_per_token: int
    shrink: int = 1
    skipped_bytes: bytes = b""

    def min_tokens(self, text: str) -> int:
        data = text.encode("utf-8", "surrogatepass")
        if self.skipped_bytes:
            data = data.translate(None, self.skipped_bytes)
        return math.ceil(len(data) / self.shrink / self.bytes_per_token)


def token_count_bound(tokenizer: Any) -> TokenCountBound | None:
    """The bound for a tokenizer, or None where it cannot be shown to hold.

    It holds for byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM tokenizers) with a
    pre-tokenizer that drops nothing, no normalizer but NFC, and no added token
    that swallows the whitespace around it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    normalizer = spec.get("normalizer")
    if model.get("type") != "BPE" or not _keeps_every_byte(spec.get("pre_tokenizer")):
        return None
    if normalizer is None:
        shrink = 1
    elif normalizer.get("type") == "NFC":
        shrink = _NFC_MAX_SHRINK
    else:
        return None
    added = spec.get("added_tokens") or []
    if any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    vocab = model.get("vocab") or {}
    symbols = _byte_symbols()
    missing = bytes(b for b, symbol in enumerate(symbols) if symbol not in vocab)
    if missing and model.get("unk_token") is not None:
        return None  # an unknown token may stand for a whole run of such bytes
    # A byte-level symbol is one byte of text; anything else counts its UTF-8 bytes,
    # which can only overstate what the token covers (the safe direction).
    alphabet = set(symbols)
    longest = max((len(t) if set(t) <= alphabet else len(t.encode()) for t in vocab),
                  default=1)
    longest_added = max((len(t["content"].encode()) for t in added), default=0)
    return TokenCountBound(max(longest, longest_added, 1), shrink, missing)


@functools.cache
def _byte_symbols() -> tuple[str, ...]:
    """The byte-level alphabet in byte order: symbol i stands for byte i (GPT-2's
    mapping: printable Latin-1 bytes are themselves, the rest shift past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return tuple(symbols[b] for b in range(256))


def _keeps_every_byte(pre_tokenizer: dict | None) -> bool:
    if pre_tokenizer is None:
        return False
    steps = pre_tokenizer.get("pretokenizers", []) if pre_tokenizer.get("type") == "Sequence" \
        else [pre_tokenizer]
    for step in steps:
        kind = step.get("type")
        if kind in ("Split", "Punctuation"):
            if step.get("behavior") not in _KEEPING_SPLIT_BEHAVIOURS:
                return False
        elif kind not in ("ByteLevel", "Digits"):
            return False
    return any(step.get("type") == "ByteLevel" for step in steps)


class RequestTokenizer:
    """The server's Hugging Face tokenizer (`hf`), with its request-sized work off
    the event loop."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        self._small = DaemonWorker("loraserve-tokenizer")
        self._large = DaemonWorker("loraserve-tokenizer-large")
        self._bound = token_count_bound(tokenizer)

    async def run(self, size: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a tokenizer thread: the one for large work when
        `size` (the characters it works on) passes LARGE_WORK_CHARS."""
        worker = self._large if size > LARGE_WORK_CHARS else self._small
        return await asyncio.wrap_future(worker.submit(fn, *args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await self.run(len(text), self._encode, text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.hf(text, add_special_tokens=add_special_tokens).input_ids

    async def decode(self, token_ids: list[int]) -> str:
        return await self.run(4 * len(token_ids), self.hf.decode, token_ids)

    def min_tokens(self, text: str) -> int:
        """A number of tokens that `text` certainly has at least (0: unknown)."""
        return 0 if self._bound is None else self._bound.min_tokens(text)

    def max_chars(self, tokens: int) -> int:
        """The most characters a text of at most `tokens` tokens may have: from the
        bound where one holds (a character is at least one byte), else
        MAX_CHARS_PER_TOKEN a token."""
        bound = self._bound
        if bound is None or bound.skipped_bytes:  # skipped bytes cost no token
            return tokens * MAX_CHARS_PER_TOKEN
        return tokens * bound.bytes_per_token * bound.shrink

    def shutdown(self) -> None:
        for worker in (self._small, self._large):
            worker.shutdown(wait=False, cancel_futures=True)
