"""Beam search, run as vLLM runs it: in the front end, above the engine.

Every step extends each live beam by one token with an engine request for that
beam's tokens (the prompt and what the beam generated) that asks for one token
and the 2 * beam_width most likely next tokens with their logprobs. Prefix
caching makes those repeated prompts cheap: only the last, partial block of a
beam is computed again. The candidates of all beams are ranked by cumulative
logprob; a candidate that ends its beam (EOS unless ignore_eos, a stop token id,
a stop string) joins the finished beams, and the best beam_width others are the
next step's beams. At the end the finished and the live beams are ranked by
vLLM's length-penalised score,

    cumulative logprob / length ** length_penalty,

the length counting the prompt's tokens and the generated ones but not a final
EOS (or stop token), and the best n are returned.

Finished beams never grow and the cumulative logprob of a live beam only falls,
so once beam_width finished beams score above anything a live beam could still
reach, the remaining steps could not change the answer: the search stops there.
With early_stopping true it stops as soon as beam_width beams have finished
(Hugging Face's rule) and returns the best of those.

Where vLLM's beam search ignores them, loraserve's also honours stop token ids
and stop strings (like EOS) and min_tokens (no beam finishes before it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# One step for several beams: each beam's tokens (prompt first) in, each beam's
# most likely next tokens out, as (token id, logprob), most likely first.
StepFn = Callable[[list[list[int]], int], Awaitable[list[list[tuple[int, float]]]]]


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    n: int  # beams returned, best first; at most beam_width
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Top logprobs listed for each returned token, as with sampling (None: none).
    logprobs: int | None = None

    @property
    def num_candidates(self) -> int:
        return 2 * self.beam_width


@dataclass
class Beam:
    # Generated tokens; a final EOS or stop token only with include_stop_str_in_output.
    token_ids: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    # Per token of token_ids: {that token: logprob, then the most likely: logprob}.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""


def beam_score(beam: Beam, prompt_ids: Sequence[int], stop_ids: set[int],
               length_penalty: float) -> float:
    """vLLM's score: the cumulative logprob over the sequence's length (prompt
    included, a final EOS or stop token not) to the power length_penalty."""
    length = len(prompt_ids) + len(beam.token_ids)
    last = beam.token_ids[-1] if beam.token_ids else (prompt_ids[-1] if prompt_ids else None)
    if last in stop_ids:
        length -= 1
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


class _Search:
    def __init__(self, prompt_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None, tokenizer: Any) -> None:
        self.prompt_ids = prompt_ids
        self.params = params
        self.tokenizer = tokenizer
        self.ending_ids = set(params.stop_token_ids)
        if eos_token_id is not None and not params.ignore_eos:
            self.ending_ids.add(eos_token_id)
        # Tokens that do not count in a beam's length when they end it.
        self.uncounted_ids = set(params.stop_token_ids)
        if eos_token_id is not None:
            self.uncounted_ids.add(eos_token_id)
        self.finished: list[Beam] = []

    def score(self, beam: Beam) -> float:
        return beam_score(beam, self.prompt_ids, self.uncounted_ids,
                          self.params.length_penalty)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids,
                                     skip_special_tokens=self.params.skip_special_tokens)

    def extend(self, beam: Beam, token: int, logprob: float,
               top: list[tuple[int, float]]) -> Beam:
        shown = self.params.logprobs or 0
        entry = {token: logprob, **dict(top[:shown])}
        return Beam(beam.token_ids + [token], beam.cum_logprob + logprob,
                    beam.logprobs + [entry])

    def finish_on_token(self, beam: Beam, token: int, logprob: float,
                        top: list[tuple[int, float]]) -> None:
        """The beam ends with `token` (EOS or a stop token id)."""
        done = self.extend(beam, token, logprob, top)
        text_ids = done.token_ids[:-1]
        if not self.params.include_stop_str_in_output:
            done.token_ids, done.logprobs = text_ids, done.logprobs[:-1]
        done.text = self.decode(text_ids)
        done.finish_reason, done.stop_reason = "stop", token
        self.finished.append(done)

    def stop_string_hit(self, beam: Beam) -> bool:
        """Whether the beam's text now holds a stop string; if so it is finished,
        its text cut there."""
        text = self.decode(beam.token_ids)
        hits = [(text.find(s), s) for s in self.params.stop if s in text]
        if not hits:
            return False
        pos, stop = min(hits)
        beam.text = text[:pos + len(stop)] if self.params.include_stop_str_in_output \
            else text[:pos]
        beam.finish_reason, beam.stop_reason = "stop", stop
        self.finished.append(beam)
        return True

    def step(self, live: list[Beam], results: list[list[tuple[int, float]]]) -> list[Beam]:
        """The next step's beams, from each live beam's most likely next tokens."""
        width = self.params.beam_width
        can_finish = len(live[0].token_ids) + 1 > self.params.min_tokens
        candidates = []
        for beam, top in zip(live, results, strict=True):
            for rank, (token, logprob) in enumerate(top[:self.params.num_candidates]):
                if token in self.ending_ids:
                    # A beam that would end before min_tokens is dropped, as
                    # sampling masks EOS and stop tokens until then.
                    if can_finish:
                        self.finish_on_token(beam, token, logprob, top)
                    continue
                candidates.append((beam.cum_logprob + logprob, rank, beam, token, logprob, top))
        # Best cumulative logprob first; ties keep beam and rank order.
        candidates.sort(key=lambda c: -c[0])
        check_stops = bool(self.params.stop) and can_finish
        new_live: list[Beam] = []
        for _, _, beam, token, logprob, top in candidates:
            if len(new_live) == width and not check_stops:
                break
            extended = self.extend(beam, token, logprob, top)
            if check_stops and self.stop_string_hit(extended):
                continue
            if len(new_live) < width:
                new_live.append(extended)
        return new_live

    def settled(self, live: list[Beam]) -> bool:
        """Whether more steps can no longer change the answer (or, with
        early_stopping true, enough beams have finished)."""
        width = self.params.beam_width
        if len(self.finished) < width:
            return False
        if self.params.early_stopping is True:
            return True
        worst_kept = sorted((self.score(b) for b in self.finished), reverse=True)[width - 1]
        return all(self._best_reachable(b) < worst_kept for b in live)

    def _best_reachable(self, beam: Beam) -> float:
        """The highest score a beam grown from this one can get: its logprob only
        falls, and its length is between its own and the longest allowed."""
        params = self.params
        # One less: a final EOS does not count (generated as a plain token when
        # ignore_eos).
        shortest = max(len(self.prompt_ids) + len(beam.token_ids) - 1, 1)
        longest = len(self.prompt_ids) + params.max_tokens
        # The score is monotonic in the length: one of the ends is the best.
        return max(beam.cum_logprob / (length ** params.length_penalty)
                   for length in (shortest, longest))

    def result(self, live: list[Beam], stopped_early: bool) -> list[Beam]:
        pool = list(self.finished)
        if not (stopped_early and self.params.early_stopping is True):
            for beam in live:
                beam.finish_reason = "length"
                beam.text = self.decode(beam.token_ids)
                pool.append(beam)
        pool.sort(key=self.score, reverse=True)
        return pool[:self.params.n]


async def beam_search(
    step: StepFn,
    prompt_ids: list[int],
    params: BeamSearchParams,
    eos_token_id: int | None,
    tokenizer: Any,
) -> list[Beam]:
    """The best params.n beams for the prompt, best first. `step` runs one engine
    step for every live beam (see StepFn); `tokenizer` decodes the beams' text."""
    search = _Search(list(prompt_ids), params, eos_token_id, tokenizer)
    num_logprobs = max(params.num_candidates, params.logprobs or 0)
    live = [Beam()]
    stopped_early = False
    for _ in range(params.max_tokens):
        results = await step([search.prompt_ids + b.token_ids for b in live], num_logprobs)
        live = search.step(live, results)
        if not live or search.settled(live):
            stopped_early = True
            break
    return search.result(live, stopped_early)
