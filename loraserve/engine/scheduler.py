"""Continuous batching with a token budget (chunked prefill), paged KV blocks with
prefix caching, preemption by recompute, the max_loras rule and the scheduling
policy.

The policy (vLLM's --scheduling-policy) orders the waiting queue: fcfs by
arrival, priority by (priority, arrival), lower first (request_queue.py). It also
picks whom to preempt when a running request needs KV blocks that are not free:
fcfs the running request that started last, priority the running request of the
highest priority value (of those, the latest to arrive), as vLLM does. A request
preempted after it was scheduled this step gives its tokens back to the budget.

A request admitted from the queue (new, or preempted) starts with the cached
blocks of its prompt's longest cached prefix (engine/kv_blocks.py) and computes
the rest like any chunk of a chunked prefill.

The max_loras rule: the adapters of all running requests count, scheduled this
step or not, and so do the pinned adapters that hold a device slot (they never
give it up). Which new adapters may take the places left is the LoRA scheduling
policy's choice (lora_admission.py: vLLM's fcfs, or slot-aware, which bounds how
long a request is passed over). A waiting request whose adapter may not join is
skipped; so is one whose adapter is still loading, or whose grammar (structured
outputs) is still compiling. A skipped request keeps its place at the front of
the queue. (When pinned adapters hold every slot, a request for another adapter
could never go: the engine fails it before it gets here.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loraserve.config import SchedulerConfig
from loraserve.engine.kv_blocks import KVBlockManager
from loraserve.engine.lora_admission import LoRAAdmission
from loraserve.engine.request import Request, RequestStatus
from loraserve.engine.request_queue import make_queue
from loraserve.lora.request import LoRARequest


@dataclass
class SchedulerOutput:
    # (request, number of its tokens to compute this step), running requests first.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Adapters that waiting requests need but that are not ready: load them.
    loras_to_load: list[LoRARequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVBlockManager, max_loras: int | None,
        lora_policy: str = "fcfs", max_lora_wait_steps: int = 32,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_loras = max_loras
        # Which adapters waiting requests may bring in (None: LoRA is off).
        self.admission = (LoRAAdmission(max_loras, lora_policy, max_lora_wait_steps,
                                        config.max_model_len)
                          if max_loras is not None else None)
        self.policy = config.policy
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def check_priority(self, priority: int) -> None:
        """Raise ValueError for a priority that this policy would ignore."""
        if priority != 0 and self.policy != "priority":
            raise ValueError(f"got priority {priority} but priority scheduling is not enabled "
                             "(--scheduling-policy priority)")

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.add(req)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def running_loras(self) -> set[str]:
        return {r.lora_name for r in self.running if r.lora_name is not None}

    def waiting_loras(self) -> set[str]:
        return {r.lora_name for r in self.waiting if r.lora_name is not None}

    def schedule(self, ready_loras: set[str] | frozenset = frozenset(),
                 slot_holders: set[str] | frozenset = frozenset(),
                 slot_resident: set[str] | frozenset = frozenset()) -> SchedulerOutput:
        """`ready_loras`: adapters usable without a disk read; `slot_holders`:
        adapters that keep a device slot whether they run or not (pinned ones);
        `slot_resident`: adapters in a device slot now."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self._schedule_running(out, budget)
        budget -= out.num_tokens
        if not out.preempted:
            allowed = None
            if self.admission is not None:
                allowed = self.admission.allowed(self.waiting, self.running, set(ready_loras),
                                                 slot_holders, slot_resident)
            self._schedule_waiting(out, budget, ready_loras, allowed)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> None:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and req.at_length_limit(req.num_output_tokens,
                                                       self.config.max_model_len):
                # Its token in flight is its last one: nothing more to compute.
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                # Out of blocks: preempt the running request the policy values least.
                victim = self._victim()
                position = self.running.index(victim)
                self.running.pop(position)
                for k, (scheduled, n) in enumerate(out.scheduled):
                    if scheduled is victim:
                        del out.scheduled[k]
                        budget += n
                        break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    return
                if position < i:
                    i -= 1
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1

    def _victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _schedule_waiting(
        self, out: SchedulerOutput, budget: int, ready_loras: set[str] | frozenset,
        allowed_loras: set[str] | None,
    ) -> None:
        """`allowed_loras`: the adapters whose requests may join (None: LoRA off)."""
        skipped: list[Request] = []
        to_load: dict[str, LoRARequest] = {}
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.pop()
            if req.num_pending or req.waiting_for_grammar:
                # Preempted with a token in flight: it can restart once that is back.
                # Or its grammar is still compiling (structured outputs).
                skipped.append(req)
                continue
            name = req.lora_name
            if name is not None:
                if name not in ready_loras:
                    to_load.setdefault(name, req.lora_request)
                    skipped.append(req)
                    continue
                if allowed_loras is not None and name not in allowed_loras:
                    req.slot_waits += 1  # ready, but its adapter had no place
                    skipped.append(req)
                    continue
            # A new or preempted request holds no blocks: it starts from the longest
            # prefix whose blocks are still cached.
            num_hit = self.kv.take_cached_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(req, num_new):
                self.kv.free(req)
                req.num_computed_tokens = 0
                skipped.append(req)
                break
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        # Requests that could not go this step keep their places at the front.
        self.waiting.put_back(skipped)
        out.loras_to_load = list(to_load.values())

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.put_back([req])

    def finish(self, req: Request) -> None:
        """Remove a request (finished, aborted or failed) and free its blocks. Looks
        the request up rather than trust its status: the engine also ends requests
        after a step failed half-way."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
