"""The engine core: takes requests and aborts, schedules each step, runs the
worker, and returns each request's new tokens. Single-threaded; the ZMQ process
(core_proc) and the offline LLM both drive it.

With async scheduling a step call schedules and launches step N, and only then
reads back step N-1's tokens: the host's scheduling, input building and output
handling run while the device computes. A token still in flight counts in its
request's length (`Request.num_pending`) and the model runner takes it from the
previous step's ids on the device. The cost: a request that stops on EOS or a
stop token has already been given one more step, whose token is dropped.

The engine reaches the model only through its executor (loraserve.executor):
`execute(step)` for a step, `call(method, ...)` for the worker's adapter
operations. The scheduler counts adapter names against max_loras and asks for
loads; the worker maps names to device slots, loads into them and reports what
is resident (engine/adapters.py keeps that report).

A request can only fail alone: add_request refuses what a step could not run
(token ids outside the vocabulary, an unloaded adapter), and an exception inside
a step fails the requests it belongs to, found by running them one at a time,
while the others keep their tokens and the loop goes on. The one exception is a
broken tensor-parallel group (a rank died, a collective failed): no request can
run any more, so TensorParallelError leaves the engine (core_proc exits on it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from loraserve.config import EngineConfig
from loraserve.distributed.parallel_state import TensorParallelError
from loraserve.engine.adapters import EngineAdapters
from loraserve.engine.kv_blocks import KVBlockManager
from loraserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)
from loraserve.engine.request import Request, RequestStatus
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.step_stats import StepLoRACounter
from loraserve.engine.structured_outputs import StructuredOutputManager
from loraserve.executor import make_executor
from loraserve.lora.errors import LoRAError
from loraserve.lora.request import LoRARequest
from loraserve.worker.input_batch import PromptLogprobsInput, SeqInput, StepInput
from loraserve.worker.sampler import PromptLogprobsBatch, SampledBatch, SamplingRow

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # With tensor parallelism this process is rank 0 and starts the other ranks.
        self.executor = make_executor(config)
        if config.lora_config is not None:
            # Decided by the worker with --max-loras auto.
            config.lora_config = self.executor.call("lora_config")
        # None without enable_lora: every adapter operation goes through it.
        self.adapters: EngineAdapters | None = (
            EngineAdapters(self.executor) if config.lora_config is not None else None)
        # Runtime adds (API loads) that ended, for core_proc to answer.
        self._finished_adds: list[tuple[LoRARequest, LoRAError | None]] = []
        # Requests whose adapter was ready when they came, and those that waited for
        # a read (the metrics' CPU cache hits and misses).
        self._lora_cache_counts = [0, 0]
        self.kv = KVBlockManager(self.executor.num_kv_blocks, config.cache_config.block_size,
                                 config.cache_config.enable_prefix_caching)
        lc = config.lora_config
        self.scheduler = Scheduler(
            config.scheduler_config, self.kv, lc.max_loras if lc else None,
            lc.scheduling if lc else "fcfs", lc.max_wait_steps if lc else 0)
        self.step_loras = StepLoRACounter()
        # Structured outputs: grammars compiled off the loop, a matcher per request.
        self.structured = StructuredOutputManager(config)
        self.requests: dict[str, Request] = {}
        # Outputs produced outside a model step (failed adapter loads, aborts).
        self._pending: list[EngineCoreOutput] = []
        # Async scheduling: the launched step whose tokens are not read back yet.
        self._in_flight: _LaunchedStep | None = None
        sc = config.scheduler_config
        logger.info(
            "engine ready: max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, "
            "KV cache for %d tokens, %s scheduling",
            sc.max_model_len, sc.max_num_seqs, sc.max_num_batched_tokens, self.kv.capacity_tokens,
            "async" if config.async_scheduling else "lockstep",
        )
        if lc is not None:
            logger.info("LoRA: max_loras %d device slots, max_cpu_loras %d, max_lora_rank %d, "
                        "%s scheduling", lc.max_loras, lc.max_cpu_loras, lc.max_lora_rank,
                        lc.scheduling)

    @property
    def lora_enabled(self) -> bool:
        return self.adapters is not None

    def lora_ready(self, name: str) -> bool:
        """Whether the adapter is in the CPU cache or a device slot, so a request
        for it runs without waiting on a load."""
        return self.adapters is not None and self.adapters.is_ready(name)

    # ---- requests ----------------------------------------------------------------

    def add_request(self, ecr: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError for one that can never run."""
        if ecr.request_id in self.requests:
            raise ValueError(f"request id {ecr.request_id!r} is already in use")
        self._check_request(ecr)
        req = Request.from_engine_request(ecr)
        if ecr.sampling_params.seed is not None:
            req.generator = torch.Generator(device=self.config.device).manual_seed(
                ecr.sampling_params.seed
            )
        self.requests[req.request_id] = req
        self.structured.add_request(req)
        self.scheduler.add_request(req)
        name = req.lora_name
        if name is not None:
            ready = self.adapters.is_ready(name)
            self._lora_cache_counts[0 if ready else 1] += 1
            if not ready:
                self.adapters.start_loads([req.lora_request])

    def _check_request(self, ecr: EngineCoreRequest) -> None:
        """Everything a step does per request must be possible: an id outside the
        vocabulary would fail (on a GPU, poison) the batched sampler of a whole step."""
        prompt_len = len(ecr.prompt_token_ids)
        max_len = self.config.scheduler_config.max_model_len
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= max_len:
            raise ValueError(
                f"the prompt has {prompt_len} tokens; max_model_len {max_len} leaves no room "
                "to generate"
            )
        if prompt_len + 1 > self.kv.capacity_tokens:
            raise ValueError(
                f"the prompt has {prompt_len} tokens but the KV cache holds only "
                f"{self.kv.capacity_tokens}"
            )
        vocab = self.config.model_config.hf_config.vocab_size
        params = ecr.sampling_params
        _check_token_ids("prompt token ids", ecr.prompt_token_ids, vocab)
        for name, token_ids in params.token_id_fields():
            _check_token_ids(name, token_ids, vocab)
        if params.bad_words and params.bad_words_token_ids is None:
            raise ValueError("bad_words must reach the engine tokenized (bad_words_token_ids)")
        self.scheduler.check_priority(ecr.priority)
        if ecr.eos_token_id is not None:
            _check_token_ids("eos_token_id", [ecr.eos_token_id], vocab)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise ValueError(
                    f"{name} must be at most the vocabulary size {vocab}, got {value}"
                )
        lora = ecr.lora_request
        if lora is not None:
            if self.adapters is None:
                raise ValueError("a LoRA adapter was requested but LoRA is not enabled")
            if self.adapters.is_retired(lora):
                raise ValueError(f"LoRA adapter {lora.lora_name!r} was unloaded")

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.finish(req)

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def check_workers(self, cause: Exception | None = None) -> None:
        """Raise TensorParallelError if a tensor-parallel rank died, or `cause` is a
        failed collective: that is the engine's failure, never a request's."""
        self.executor.check(cause)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending) or self.has_step_in_flight

    # ---- adapters ------------------------------------------------------------------

    def _require_lora(self) -> EngineAdapters:
        if self.adapters is None:
            raise ValueError("LoRA is not enabled; start with enable_lora (--enable-lora)")
        return self.adapters

    def add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        """Load now (raises LoRAError), cache it and give it a device slot if one is
        free or held by an adapter no running request uses."""
        self._require_lora().add(lora_request, pinned, self.scheduler.running_loras())
        self._after_add(lora_request)

    def start_add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        """add_lora without stalling the loop: the read runs in the background and
        poll_lora_adds reports when the adapter is in."""
        self._require_lora().begin_add(lora_request, pinned)

    def poll_lora_adds(self) -> list[tuple[LoRARequest, LoRAError | None]]:
        """Runtime adds that ended since the last call (committing finished reads)."""
        if self.adapters is not None and self.adapters.adds_pending:
            self._pending += self._poll_lora_loads()
        finished, self._finished_adds = self._finished_adds, []
        return finished

    def _poll_lora_loads(self) -> list[EngineCoreOutput]:
        """Commit the finished background reads; the requests of a failed one fail."""
        done = self.adapters.poll(self.scheduler.running_loras())
        outputs = []
        for name, error in done.failed:
            outputs += self._fail_requests_of(name, str(error), queue=False)
        for lora_request, error in done.adds:
            if error is None:
                self._after_add(lora_request)
        self._finished_adds += done.adds
        return outputs

    def _after_add(self, lora_request: LoRARequest) -> None:
        if lora_request.load_inplace:
            # New weights under the same name: blocks cached with the old ones are stale.
            self.kv.reset_prefix_cache()

    def remove_lora(self, lora_name: str) -> bool:
        """Free the adapter for good: its requests fail, and a request that still
        names it (resolved before the unload) is refused instead of loading it again."""
        adapters = self._require_lora()
        ids = {r.lora_request.lora_int_id for r in self.requests.values()
               if r.lora_name == lora_name}
        # Their adapter is gone: answer them with an error rather than leave them.
        self._fail_requests_of(lora_name, f"LoRA adapter {lora_name!r} was unloaded")
        # The name may come back with other weights.
        self.kv.reset_prefix_cache()
        return adapters.remove(lora_name, ids)

    def pin_lora(self, lora_name: str) -> None:
        self._require_lora().pin(lora_name)

    def lora_memory_usage(self) -> dict[str, int]:
        return self.adapters.memory_usage() if self.adapters else {}

    def list_loras(self) -> list[str]:
        return sorted(self.adapters.residency.cpu) if self.adapters else []

    # ---- the step ------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        outputs = self._pending
        self._pending = []
        try:
            self._step(outputs)
        except TensorParallelError:
            raise
        except Exception as exc:  # noqa: BLE001 - the loop must outlive any bug
            # Outside any one request's work (scheduling, adapter bookkeeping): no
            # culprit to single out, so every request is answered with the error
            # and the engine starts clean.
            logger.exception("engine step failed; failing all %d requests", len(self.requests))
            outputs += self._fail(list(self.requests.values()), _step_error(exc))
            self._in_flight = None
        # Stats are built by whoever sends them (core_proc), not on every step.
        return EngineCoreOutputs(outputs=outputs)

    def _step(self, outputs: list[EngineCoreOutput]) -> None:
        if self._in_flight is not None and not self._can_overlap():
            self._finish(self._take_in_flight(), outputs)
        for req, error in self.structured.poll():
            outputs += self._fail([req], error)
        ready: set[str] = set()
        slot_holders: frozenset[str] = frozenset()
        adapters = self.adapters
        if adapters is not None:
            outputs += self._poll_lora_loads()
            ready = {
                name for name in self.scheduler.waiting_loras() | self.scheduler.running_loras()
                if adapters.is_ready(name)
            }
            slot_holders = adapters.residency.pinned_slots
            outputs += self._fail_slotless(slot_holders)
        sched = self.scheduler.schedule(ready, slot_holders,
                                        adapters.residency.slots if adapters else frozenset())
        if sched.loras_to_load:
            adapters.start_loads(sched.loras_to_load)
        launched = self._launch_isolating(sched.scheduled, outputs) if sched.scheduled else None
        if self._in_flight is not None:
            self._finish(self._take_in_flight(), outputs)
        if launched is not None:
            # Its grammar rows' masks need the tokens just read back.
            self._complete_deferred(launched)
            if self.config.async_scheduling:
                self._in_flight = launched
            else:
                self._finish(launched, outputs)

    def _take_in_flight(self) -> _LaunchedStep:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _can_overlap(self) -> bool:
        """Penalties and multi-token bad words read a request's output: those steps
        wait for the last one. (A grammar's token mask needs the last token too, but
        only at sampling: its row is sampled after the step is launched, see
        _complete_deferred.)"""
        if not self.config.async_scheduling:
            return False
        return not any(r.sampling_params.reads_output_tokens for r in self.scheduler.running)

    def _launch_isolating(
        self, scheduled: list[tuple[Request, int]], outputs: list[EngineCoreOutput]
    ) -> _LaunchedStep | None:
        """Launch the step; if it raises, run its requests one at a time, each read
        back at once, so that only those that fail on their own are failed."""
        try:
            return self._launch(scheduled)
        except Exception as exc:  # noqa: BLE001 - isolated below
            self.check_workers(exc)
            logger.exception("a step of %d requests failed; retrying each alone",
                             len(scheduled))
        # A retried request must find its last token on the host, not in flight.
        if self._in_flight is not None:
            self._finish(self._take_in_flight(), outputs)
        for req, n in scheduled:
            if req.status is not RequestStatus.RUNNING:
                continue  # it stopped (or failed) with the step just read back
            try:
                launched = self._launch([(req, n)])
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                self.check_workers(exc)
                logger.warning("request %s fails on its own: %s: %s", req.request_id,
                               type(exc).__name__, exc)
                outputs += self._fail([req], _step_error(exc))
                continue
            self._finish(launched, outputs)
        return None

    def _launch(self, scheduled: list[tuple[Request, int]]) -> _LaunchedStep:
        """Build and launch one step. Requests change only once the launch went
        through, so a failed launch can be retried as if it never happened."""
        seqs = []
        sampled_reqs = []
        prompt_reqs: list[tuple[Request, int]] = []  # and the positions they read
        for req, n in scheduled:
            start = req.num_computed_tokens
            samples = start + n == req.num_tokens
            prompt_lps = _prompt_logprobs_input(req, start, n)
            if prompt_lps is not None:
                prompt_reqs.append((req, start + prompt_lps.first + len(prompt_lps.targets)))
            seqs.append(SeqInput(
                request_id=req.request_id,
                token_ids=req.token_ids(start, start + n),
                start_pos=start,
                block_ids=req.block_ids,
                lora_name=req.lora_name,
                sampling=SamplingRow(
                    req.sampling_params, req.prompt_token_ids, req.output_token_ids,
                    req.eos_token_id, req.generator, req.num_pending,
                ) if samples else None,
                prompt_logprobs=prompt_lps,
            ))
            if samples:
                sampled_reqs.append(req)
                # A grammar's mask needs the token still in flight: sampled later.
                seqs[-1].sampling.deferred = req.grammar is not None
        step = StepInput(seqs, frozenset(self.scheduler.running_loras()))
        out = self.executor.execute(step)
        if self.adapters is not None:
            self.adapters.update(out.lora)
        batch, prompt_batch = out.sampled, out.prompt_logprobs
        self.step_loras.record(step.lora_names())
        for req, n in scheduled:
            req.num_computed_tokens += n
            self.kv.cache_computed_blocks(req)
        for req in sampled_reqs:
            req.num_pending += 1
        for req, sent in prompt_reqs:
            req.num_prompt_logprobs_sent = sent
        return _LaunchedStep(sampled_reqs, batch, [r for r, _ in prompt_reqs], prompt_batch,
                             [r for r in sampled_reqs if r.grammar is not None])

    def _complete_deferred(self, launched: _LaunchedStep) -> None:
        """Sample a launched step's grammar rows, once every token before theirs is
        accepted by their matchers (the step before was read back): the device
        computed the step meanwhile. A request that ended meanwhile is sampled
        without a mask, and its token dropped."""
        if not launched.deferred:
            return
        reqs, launched.deferred = launched.deferred, []
        live = [r for r in reqs
                if r.status is not RequestStatus.FINISHED and not self.structured.completed(r)]
        masks = dict(zip(live, self.structured.token_masks(live), strict=True))
        self.executor.sample_deferred([masks.get(r) for r in reqs])

    def _finish(self, launched: _LaunchedStep, outputs: list[EngineCoreOutput]) -> None:
        """Read a launched step's tokens (and prompt logprobs) back and hand them to
        their requests."""
        self._complete_deferred(launched)
        if launched.batch is None and launched.prompt_batch is None:
            return
        try:
            result = launched.batch.to_host() if launched.batch is not None else None
            prompt_lps = (launched.prompt_batch.to_host()
                          if launched.prompt_batch is not None else [])
        except Exception as exc:  # noqa: BLE001 - the step's tokens are lost, not the engine
            self.check_workers(exc)
            logger.exception("reading back a step of %d requests failed",
                             len(launched.requests))
            for req in launched.requests:
                req.num_pending -= 1
            hit = dict.fromkeys(launched.requests + launched.prompt_requests)
            alive = [r for r in hit if r.status is not RequestStatus.FINISHED]
            outputs += self._fail(alive, _step_error(exc))
            return
        # Prompt logprobs ride with the request's sampled token when this step has
        # one, else they go out alone.
        pending = dict(zip(launched.prompt_requests, prompt_lps, strict=True))
        if result is not None:
            for req, token, logprobs in zip(launched.requests, result.token_ids,
                                            result.logprobs, strict=True):
                req.num_pending -= 1
                if req.status == RequestStatus.FINISHED:
                    continue  # aborted, failed, or stopped while this step ran
                req.output_token_ids.append(token)
                if not self.structured.accept(req, token):
                    outputs += self._fail([req], _grammar_error(req, token))
                    continue
                finish, stop_reason = self._check_stop(req, token)
                outputs.append(EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[token],
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    finish_reason=finish,
                    stop_reason=stop_reason,
                    num_prompt_tokens=len(req.prompt_token_ids),
                    prompt_logprobs=pending.pop(req, None),
                    times=req.first_token_times(),
                ))
                if finish is not None:
                    self.scheduler.finish(req)
                    del self.requests[req.request_id]
        for req, lps in pending.items():
            if req.status == RequestStatus.FINISHED:
                continue
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[],
                num_prompt_tokens=len(req.prompt_token_ids), prompt_logprobs=lps,
            ))

    def _check_stop(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        params = req.sampling_params
        num_out = len(req.output_token_ids)  # a token in flight does not count yet
        if self.structured.completed(req):
            # Its grammar took its end token: nothing may follow.
            return FinishReason.STOP, token if token in (params.stop_token_ids or ()) else None
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token == req.eos_token_id:
                return FinishReason.STOP, None
            if params.stop_token_ids and token in params.stop_token_ids:
                return FinishReason.STOP, token
        if req.at_length_limit(num_out, self.config.scheduler_config.max_model_len):
            return FinishReason.LENGTH, None
        return None, None

    def _fail_slotless(self, pinned: frozenset[str]) -> list[EngineCoreOutput]:
        """Pinned adapters keep their device slots for good: once they hold every
        slot, a waiting request for any other adapter could never be scheduled, so
        it fails now rather than wait without end."""
        max_loras = self.config.lora_config.max_loras
        if len(pinned) < max_loras:
            return []
        stuck = [r for r in self.scheduler.waiting
                 if r.lora_name is not None and r.lora_name not in pinned]
        outputs = []
        for name in sorted({r.lora_name for r in stuck}):
            error = (f"LoRA adapter {name!r} cannot run: all {max_loras} device slots "
                     f"(max_loras) are held by pinned adapters ({', '.join(sorted(pinned))})")
            logger.warning("%s; failing its requests", error)
            outputs += self._fail([r for r in stuck if r.lora_name == name], error)
        return outputs

    def _fail_requests_of(
        self, lora_name: str, error: str, queue: bool = True
    ) -> list[EngineCoreOutput]:
        outputs = self._fail([r for r in self.requests.values() if r.lora_name == lora_name],
                             error)
        if queue:
            self._pending += outputs
        return outputs

    def _fail(self, reqs: list[Request], error: str) -> list[EngineCoreOutput]:
        """End requests with an error: their KV blocks are freed, and their adapter
        slots are no longer held for them."""
        outputs = []
        for req in reqs:
            self.scheduler.finish(req)
            del self.requests[req.request_id]
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[],
                finish_reason=FinishReason.ERROR, error=error,
                num_prompt_tokens=len(req.prompt_token_ids),
            ))
        return outputs

    def get_stats(self) -> SchedulerStats:
        stats = SchedulerStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage(),
            running_lora_adapters=sorted(self.scheduler.running_loras()),
            waiting_lora_adapters=sorted(self.scheduler.waiting_loras()),
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_tokens=(self.kv.prefix_cache_stats.queries,
                                 self.kv.prefix_cache_stats.hits),
        )
        stats.step_lora_adapter_counts, stats.step_lora_adapters_sum = self.step_loras.totals()
        if self.adapters is not None:
            resident = self.adapters.residency
            stats.gpu_lora_adapters = sorted(resident.slots)
            stats.cpu_lora_adapters = sorted(resident.cpu)
            stats.pinned_lora_adapters = sorted(resident.pinned)
            stats.lora_load_time_counts = list(resident.load_time_counts)
            stats.lora_load_time_sum_s = resident.load_time_sum_s
            stats.lora_cache_hits, stats.lora_cache_misses = self._lora_cache_counts
        return stats

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()


@dataclass
class _LaunchedStep:
    requests: list[Request]  # those that sample, in the batch's row order
    batch: SampledBatch | None
    # Those that read prompt logprobs, in the prompt batch's order.
    prompt_requests: list[Request] = field(default_factory=list)
    prompt_batch: PromptLogprobsBatch | None = None
    # Those whose rows wait for their grammars' masks (sampled by _complete_deferred).
    deferred: list[Request] = field(default_factory=list)


def _prompt_logprobs_input(req: Request, start: int, n: int) -> PromptLogprobsInput | None:
    """What a chunk of `n` tokens from `start` reads for the request's prompt
    logprobs: position i's logits give prompt token i + 1, for the positions not
    sent before."""
    k = req.sampling_params.prompt_logprobs
    if k is None:
        return None
    lo = max(start, req.num_prompt_logprobs_sent)
    hi = min(start + n, len(req.prompt_token_ids) - 1)
    if lo >= hi:
        return None
    return PromptLogprobsInput(k, lo - start, req.prompt_token_ids[lo + 1:hi + 1])


def _check_token_ids(what: str, token_ids: list[int], vocab: int) -> None:
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):
        bad = next(t for t in token_ids if t < 0 or t >= vocab)
        raise ValueError(f"{what} must be in [0, {vocab}), got {bad}")


def _grammar_error(req: Request, token: int) -> str:
    return (f"the sampled token {token} breaks the request's structured-output constraint "
            f"after {len(req.output_token_ids) - 1} tokens (min_tokens can force a token the "
            "constraint does not allow)")


def _step_error(exc: Exception) -> str:
    return f"the engine failed while computing this request ({type(exc).__name__}: {exc})"
