"""Async scheduling (on by default) launches step N+1 before step N's tokens are
read back. It must give the same outputs as stepping in lockstep, and lose
nothing when requests stop, are aborted or are preempted while a step runs."""

from __future__ import annotations

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.engine.protocol import EngineCoreRequest


def _outputs(llm: LLM, prompts, params, loras):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras,
                        use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs)
            for o in outs]


def test_async_matches_lockstep_across_stops_seeds_penalties(llama_dir, llama_adapters,
                                                            prompts):
    lockstep = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16,
                   async_scheduling=False)
    r8 = LoRARequest("r8", 1, llama_adapters["r8"])
    qv = LoRARequest("r16_qv", 2, llama_adapters["r16_qv"])
    # A stop token that greedy decoding of prompt 2 meets mid-way, so that request
    # stops while the engine has already launched its next step.
    (probe,) = _outputs(lockstep, [prompts[2]],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), [qv])
    stop_id = probe[0][4]
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=9, min_tokens=4, logprobs=2,
                       ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]),
        SamplingParams(temperature=1.0, seed=3, top_k=5, max_tokens=8,
                       repetition_penalty=1.3, ignore_eos=True),
    ]
    loras = [r8, None, qv, None]
    want = _outputs(lockstep, prompts, params, loras)
    overlapped = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)
    assert overlapped.config.async_scheduling
    got = _outputs(overlapped, prompts, params, loras)
    assert got == want
    assert want[2][1] == "stop" and len(want[2][0]) < 12
    assert [len(w[0]) for w in want] == [12, 9, len(want[2][0]), 8]


def test_abort_and_finish_while_a_step_is_in_flight(llama_dir, prompts):
    llm = LLM(llama_dir, max_num_seqs=4)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        engine.add_request(EngineCoreRequest(
            request_id=f"r{i}", prompt_token_ids=p, sampling_params=params,
            eos_token_id=None, lora_request=None, arrival_time=0.0))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    finished: dict[str, str] = {}
    steps = 0
    while engine.has_unfinished_requests():
        out = engine.step()
        steps += 1
        for o in out.outputs:
            assert o.request_id not in finished, "output after the request ended"
            tokens[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason.name
        if steps == 3:
            assert engine.has_step_in_flight
            engine.abort_requests(["r1"])
            finished["r1"] = "ABORT"
    assert len(tokens["r0"]) == len(tokens["r2"]) == 6
    assert finished["r0"] == finished["r2"] == "LENGTH"
    assert len(tokens["r1"]) < 6
    # Nothing left behind: every KV block is free again.
    assert engine.kv.usage() == 0 and not engine.has_step_in_flight
