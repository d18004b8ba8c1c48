"""Compiles constraints against the model's tokenizer on worker threads, and keeps
the compiled grammars by constraint, so that requests with the same schema share
one compile.

The tokenizer and xgrammar's compiler are built on first use, on a worker thread
too: an engine that never sees a constraint never pays for them, and the engine
loop never waits for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from loraserve.structured_output.grammar import any_whitespace, build_grammar

if TYPE_CHECKING:
    import xgrammar as xgr

    from loraserve.config import StructuredOutputsConfig
    from loraserve.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used first out). A compiled JSON schema
# holds token masks for its states: small, but not nothing.
MAX_CACHED_GRAMMARS = 256
# Threads that compile grammars side by side (xgrammar's compiler is thread-safe),
# and threads xgrammar uses inside one compile.
_COMPILE_WORKERS = 2
_XGRAMMAR_THREADS = 4


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 config: StructuredOutputsConfig) -> None:
        """`load_tokenizer`: returns the model's Hugging Face tokenizer; `vocab_size`:
        the rows of the model's logits, which the token masks cover."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.config = config
        self._pool = ThreadPoolExecutor(_COMPILE_WORKERS, thread_name_prefix="grammar-compile")
        # The cache is shared with the compile threads (a failed compile leaves it);
        # building the compiler takes seconds and has a lock of its own.
        self._cache_lock = threading.RLock()
        self._init_lock = threading.Lock()
        self._xgr_compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of the constraint, as a future (shared with every
        request that has the same constraint). A future that fails carries a
        GrammarError (or the error that stopped the compiler) for the request."""
        key = params.cache_key(any_whitespace(params, self.config))
        with self._cache_lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        # A failure is not kept: the next request with it tries again.
        future.add_done_callback(lambda done: self._forget_failure(key, done))
        return future

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._cache_lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        compiler = self._compiler()
        start = time.perf_counter()
        compiled = compiler.compile_grammar(build_grammar(params, self.config))
        logger.debug("compiled a %s grammar in %.1f ms", params.kind,
                     (time.perf_counter() - start) * 1e3)
        return compiled

    def _compiler(self) -> xgr.GrammarCompiler:
        with self._init_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                start = time.perf_counter()
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(),
                                                          vocab_size=self.vocab_size)
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=_XGRAMMAR_THREADS)
                logger.info("structured outputs: xgrammar ready for a vocabulary of %d in "
                            "%.1f s", self.vocab_size, time.perf_counter() - start)
            return self._xgr_compiler

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
