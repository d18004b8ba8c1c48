"""The engine core's side of structured outputs.

A request with a constraint gets its grammar compiled on a worker thread (the
scheduler leaves it waiting until then, like a request whose adapter is loading,
and runs the others), then a matcher of its own. Each step the matchers of the
rows that sample fill that step's token masks; each sampled token advances its
request's matcher, and a matcher that reaches its end ends the request.

With async scheduling a step is launched before the step in flight is read back,
so a row's mask (which needs that step's token) is not known at launch: the
engine marks grammar rows deferred, the runner samples the others with the step
and keeps the grammar rows' logits, and once the step before is read back and its
tokens accepted, the engine fills the masks and the runner samples those rows
(ModelRunner.sample_deferred), before the next step is launched. The device
computes the step meanwhile; nothing waits for it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import torch

from loraserve.engine.request import RequestStatus
from loraserve.structured_output.bitmask import TokenMask
from loraserve.structured_output.grammar import GrammarError
from loraserve.structured_output.request_grammar import RequestGrammar

if TYPE_CHECKING:
    import xgrammar as xgr

    from loraserve.config import EngineConfig
    from loraserve.engine.request import Request
    from loraserve.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.vocab_size = config.model_config.hf_config.vocab_size
        self._pin_memory = config.device.type == "cuda"
        self._compiler: GrammarCompiler | None = None
        self._batch_matcher: Any = None
        # Requests whose grammar is still compiling.
        self._compiling: list[Request] = []

    def add_request(self, req: Request) -> None:
        """Start compiling the request's grammar, if it has a constraint."""
        params = req.sampling_params.structured_outputs
        if params is None:
            return
        req.grammar = RequestGrammar(self._grammar_compiler().compile(params))
        self._compiling.append(req)

    def poll(self) -> list[tuple[Request, str]]:
        """Give a matcher to each request whose grammar is compiled now; returns the
        requests whose grammar failed to compile, with the reason."""
        if not self._compiling:
            return []
        failed, compiling = [], []
        for req in self._compiling:
            if req.status is RequestStatus.FINISHED:
                continue  # aborted while it compiled
            if not req.grammar.compiled.done():
                compiling.append(req)
                continue
            error = req.grammar.compiled.exception()
            if error is None:
                req.grammar.matcher = self._matcher(req.grammar.compiled.result(), req)
            elif isinstance(error, GrammarError):
                failed.append((req, str(error)))
            else:
                logger.error("compiling the grammar of request %s failed: %s: %s",
                             req.request_id, type(error).__name__, error)
                failed.append((req, "the grammar could not be compiled "
                                    f"({type(error).__name__}: {error})"))
        self._compiling = compiling
        return failed

    def token_masks(self, reqs: list[Request]) -> list[TokenMask | None]:
        """The token masks of the requests that sample this step (None for those
        without a grammar), filled from their matchers as they stand."""
        rows = [i for i, req in enumerate(reqs) if req.grammar is not None]
        masks: list[TokenMask | None] = [None] * len(reqs)
        if not rows:
            return masks
        table = torch.empty((len(rows), math.ceil(self.vocab_size / 32)), dtype=torch.int32,
                            pin_memory=self._pin_memory)
        self._batch().batch_fill_next_token_bitmask(
            [reqs[i].grammar.matcher for i in rows], table)
        for row, i in enumerate(rows):
            masks[i] = TokenMask(table, row)
        return masks

    @staticmethod
    def accept(req: Request, token: int) -> bool:
        """Advance the request's matcher by its new token; False when the grammar does
        not allow the token (the request's output no longer fits its constraint)."""
        grammar = req.grammar
        if grammar is None:
            return True
        return grammar.matcher.accept_token(token)

    @staticmethod
    def completed(req: Request) -> bool:
        """Whether the request's grammar has reached its end (its stop token
        accepted): nothing more may follow."""
        return req.grammar is not None and req.grammar.matcher.is_terminated()

    def shutdown(self) -> None:
        if self._compiler is not None:
            self._compiler.shutdown()

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            from loraserve.engine.tokenizer import load_tokenizer
            from loraserve.structured_output.compiler import GrammarCompiler

            self._compiler = GrammarCompiler(lambda: load_tokenizer(self.config),
                                             self.vocab_size,
                                             self.config.structured_outputs_config)
        return self._compiler

    def _batch(self) -> Any:
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher()
        return self._batch_matcher

    @staticmethod
    def _matcher(compiled: xgr.CompiledGrammar, req: Request) -> xgr.GrammarMatcher:
        import xgrammar as xgr

        # The request's end-of-sequence token ends the grammar; without one the
        # tokenizer's own, and without any the grammar ends as soon as it is complete.
        if req.eos_token_id is not None:
            return xgr.GrammarMatcher(compiled, override_stop_tokens=[req.eos_token_id])
        has_stop = bool(compiled.tokenizer_info.stop_token_ids)
        return xgr.GrammarMatcher(compiled, terminate_without_stop_token=not has_stop)
