"""No request and no adapter can take the engine down: token ids outside the
vocabulary are refused when a request is added, a fault in one request's step
fails that request alone while the others keep their tokens, an unloaded adapter
stays unloaded however late its requests arrive, and the engine sizes torch's CPU
thread pool for the cores it may use."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections import defaultdict

import httpx
import pytest
import torch
from serve_utils import ServerProcess

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason
from loraserve.worker.process import MAX_AUTO_THREADS, pick_num_threads
from loraserve.worker.sampler import SampledBatch

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "lockstep"])
def llm(request, llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
               max_num_seqs=8, async_scheduling=request.param)


def _request(rid: str, prompt: list[int], params: SamplingParams = GREEDY,
             lora: LoRARequest | None = None, eos: int | None = None) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), params, eos, lora)


def _run(engine, requests: list[EngineCoreRequest]) -> tuple[dict, dict[str, EngineCoreOutput]]:
    """Add the requests and step until the engine is idle: each request's tokens
    and its last (finishing) output."""
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = defaultdict(list)
    finished: dict[str, EngineCoreOutput] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step().outputs:
            assert out.request_id not in finished, "output after the request ended"
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return tokens, finished


def _assert_clean(engine) -> None:
    """Nothing left behind: no request, no KV block, no step in flight."""
    assert not engine.requests and not engine.scheduler.has_requests()
    assert engine.kv.usage() == 0 and not engine.has_step_in_flight


def _reference(engine, prompts) -> dict[str, list[int]]:
    tokens, finished = _run(engine, [_request(f"ref{i}", p) for i, p in enumerate(prompts)])
    assert all(f.finish_reason == FinishReason.LENGTH for f in finished.values())
    return {f"ref{i}": tokens[f"ref{i}"] for i in range(len(prompts))}


# ---- token ids outside the vocabulary ------------------------------------------------


@pytest.mark.parametrize("field,params,eos", [
    ("stop_token_ids", SamplingParams(max_tokens=4, stop_token_ids=[1000000], min_tokens=2),
     None),
    ("stop_token_ids", SamplingParams(max_tokens=4, stop_token_ids=[3, 100000]), None),
    ("eos_token_id", SamplingParams(max_tokens=4, min_tokens=2), 1000000),
    ("logprobs", SamplingParams(max_tokens=4, logprobs=1000000), None),
])
def test_out_of_range_ids_are_refused_when_added(llm, prompts, field, params, eos):
    engine = llm.engine
    with pytest.raises(ValueError, match=field):
        engine.add_request(_request("bad", prompts[0], params, eos=eos))
    assert "bad" not in engine.requests
    tokens, finished = _run(engine, [_request("ok", prompts[0])])
    assert len(tokens["ok"]) == MAX_TOKENS
    _assert_clean(engine)


def test_the_largest_id_of_the_vocabulary_is_accepted(llm, prompts):
    vocab = llm.config.model_config.hf_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[vocab - 1],
                            min_tokens=2, ignore_eos=True)
    tokens, finished = _run(llm.engine, [_request("edge", prompts[0], params)])
    assert finished["edge"].finish_reason != FinishReason.ERROR
    assert len(tokens["edge"]) >= 2


# ---- a fault inside one request's step ------------------------------------------------


def test_an_out_of_range_stop_id_past_the_checks_fails_only_its_request(llm, prompts):
    """The real sampler fault (min_tokens masking indexes the logits with the stop
    ids), reached by changing a request's parameters after it was accepted."""
    engine = llm.engine
    want = _reference(engine, prompts[:3])
    bad_params = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=[5], min_tokens=2)
    requests = [_request(f"ref{i}", p) for i, p in enumerate(prompts[:3])]
    requests.insert(1, _request("bad", prompts[3], bad_params))
    for r in requests:
        engine.add_request(r)
    engine.requests["bad"].sampling_params.stop_token_ids = [1000000]
    tokens, finished = _run(engine, [])
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "IndexError" in finished["bad"].error
    assert {rid: tokens[rid] for rid in want} == want
    assert all(finished[rid].finish_reason == FinishReason.LENGTH for rid in want)
    _assert_clean(engine)


def test_a_sampler_fault_mid_stream_fails_only_that_request(llm, prompts, monkeypatch):
    engine = llm.engine
    want = _reference(engine, prompts[:3])
    bad_prompt = prompts[3]
    sample = engine.executor.driver.sampler.sample

    def faulty(logits, rows):
        # The bad request's third token, while the others decode in the same batch.
        if any(r.prompt_token_ids == bad_prompt and len(r.output_token_ids) + r.num_pending == 2
               for r in rows):
            raise RuntimeError("injected sampler fault")
        return sample(logits, rows)

    monkeypatch.setattr(engine.executor.driver.sampler, "sample", faulty)
    requests = [_request(f"ref{i}", p) for i, p in enumerate(prompts[:3])]
    requests.append(_request("bad", bad_prompt))
    tokens, finished = _run(engine, requests)
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "injected sampler fault" in finished["bad"].error
    assert len(tokens["bad"]) == 2  # the tokens before the fault were delivered
    assert {rid: tokens[rid] for rid in want} == want
    _assert_clean(engine)
    monkeypatch.undo()
    assert _reference(engine, prompts[:3]) == want


def test_a_failed_read_back_fails_that_steps_requests_and_the_engine_goes_on(
        llm, prompts, monkeypatch):
    engine = llm.engine
    want = _reference(engine, prompts[:2])
    to_host = SampledBatch.to_host
    calls = {"n": 0}

    def failing_once(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected read-back fault")
        return to_host(self)

    monkeypatch.setattr(SampledBatch, "to_host", failing_once)
    tokens, finished = _run(engine, [_request(f"ref{i}", p) for i, p in enumerate(prompts[:2])])
    assert {f.finish_reason for f in finished.values()} == {FinishReason.ERROR}
    assert all("injected read-back fault" in f.error for f in finished.values())
    # Each got the tokens of the steps read back before the fault, and no more.
    assert all(tokens[rid] == want[rid][:2] for rid in want)
    _assert_clean(engine)
    assert _reference(engine, prompts[:2]) == want


def test_a_fault_outside_any_request_fails_all_and_the_engine_goes_on(
        llm, prompts, monkeypatch):
    engine = llm.engine
    want = _reference(engine, prompts[:2])
    schedule = engine.scheduler.schedule
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected scheduler fault")
        return schedule(*args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "schedule", failing_once)
    tokens, finished = _run(engine, [_request(f"ref{i}", p) for i, p in enumerate(prompts[:2])])
    assert {f.finish_reason for f in finished.values()} == {FinishReason.ERROR}
    assert all("injected scheduler fault" in f.error for f in finished.values())
    _assert_clean(engine)
    assert _reference(engine, prompts[:2]) == want


# ---- unloading is for good -------------------------------------------------------------


def _resident(engine, name: str) -> bool:
    manager = engine.executor.driver.loras
    return (name in manager.cpu_names() or name in manager.slot_names()
            or name in engine.lora_memory_usage() or name in manager.store._loading)


def test_a_request_for_an_unloaded_adapter_is_refused_and_loads_nothing(
        llm, llama_adapters, prompts):
    engine = llm.engine
    lora = LoRARequest("gone", 41, llama_adapters["r8"])
    engine.add_lora(lora)
    assert engine.remove_lora("gone")
    with pytest.raises(ValueError, match="'gone' was unloaded"):
        engine.add_request(_request("late", prompts[0], lora=lora))
    _run(engine, [_request("other", prompts[1])])
    assert not _resident(engine, "gone")
    _assert_clean(engine)
    # Loading it again on purpose brings it back.
    engine.add_lora(lora)
    tokens, finished = _run(engine, [_request("again", prompts[0], lora=lora)])
    assert finished["again"].finish_reason == FinishReason.LENGTH
    assert engine.remove_lora("gone")


def test_unloading_an_evicted_adapter_still_refuses_its_requests(
        llm, llama_adapters, prompts):
    engine = llm.engine
    names = ["ev1", "ev2", "ev3"]  # max_cpu_loras=2: ev1 leaves the CPU cache
    loras = {n: LoRARequest(n, 50 + i, llama_adapters["r8"]) for i, n in enumerate(names)}
    for n in names:
        engine.add_lora(loras[n])
    assert not _resident(engine, "ev1")
    engine.remove_lora("ev1")
    with pytest.raises(ValueError, match="'ev1' was unloaded"):
        engine.add_request(_request("late", prompts[0], lora=loras["ev1"]))
    assert not _resident(engine, "ev1")
    for n in names[1:]:
        engine.remove_lora(n)


def test_requests_waiting_on_a_load_fail_when_it_is_unloaded(llm, llama_adapters, prompts):
    engine = llm.engine
    lora = LoRARequest("waits", 61, llama_adapters["r16_qv"])
    engine.add_request(_request("w0", prompts[0], lora=lora))  # starts a background load
    engine.add_request(_request("w1", prompts[1], lora=lora))
    store = engine.executor.driver.loras.store
    (future,) = [f for name, (_, f) in store._loading.items() if name == "waits"]
    engine.remove_lora("waits")
    # Let the disk read finish (unless it was cancelled in time): its result is dropped.
    concurrent.futures.wait([future], timeout=60)
    tokens, finished = _run(engine, [])
    for rid in ("w0", "w1"):
        assert finished[rid].finish_reason == FinishReason.ERROR
        assert "'waits' was unloaded" in finished[rid].error
    assert not _resident(engine, "waits")
    _assert_clean(engine)


def test_a_load_that_finishes_for_an_unloaded_adapter_is_dropped(llm, llama_adapters):
    """Whoever started it, a disk read of a retired adapter never becomes resident."""
    manager = llm.engine.executor.driver.loras
    lora = LoRARequest("stale", 71, llama_adapters["r1"])
    manager.add(lora)
    manager.remove("stale")
    manager.start_loads([lora])
    (_, future) = manager.store._loading["stale"]
    concurrent.futures.wait([future], timeout=60)
    assert manager.finished_loads() == []
    assert not _resident(llm.engine, "stale")


# ---- the engine process's loop ------------------------------------------------------------


class _FakeCore:
    """Stands in for EngineCore behind EngineCoreProc: records what reaches it."""

    def __init__(self) -> None:
        self.added: list[str] = []
        self.loras_added: list[str] = []
        self.reading: list[LoRARequest] = []
        self.release_read = threading.Event()
        self.lora_enabled = True

    def add_request(self, request: EngineCoreRequest) -> None:
        self.added.append(request.request_id)

    def get_stats(self):
        from loraserve.engine.protocol import SchedulerStats

        return SchedulerStats()

    def start_add_lora(self, lora_request: LoRARequest, pinned: bool = False) -> None:
        self.reading.append(lora_request)

    def poll_lora_adds(self) -> list[tuple[LoRARequest, None]]:
        """The reads end once release_read is set; then their adapters are in."""
        if not self.release_read.is_set():
            return []
        done, self.reading = self.reading, []
        self.loras_added += [lora.lora_name for lora in done]
        return [(lora, None) for lora in done]

    def remove_lora(self, lora_name: str) -> bool:
        self.reading = [lora for lora in self.reading if lora.lora_name != lora_name]
        return True


@pytest.fixture()
def engine_proc():
    import zmq

    from loraserve.engine.core_proc import EngineCoreProc

    ctx = zmq.Context()
    sockets = {kind: ctx.socket(kind) for kind in (zmq.PUSH, zmq.PULL)}
    engine_in, engine_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    engine_in.bind("inproc://engine-in")
    engine_out.bind("inproc://engine-out")
    sockets[zmq.PUSH].connect("inproc://engine-in")
    sockets[zmq.PULL].connect("inproc://engine-out")
    core = _FakeCore()
    proc = EngineCoreProc(core, engine_in, engine_out, parent_pid=0)
    yield proc, core, sockets[zmq.PUSH], sockets[zmq.PULL]
    core.release_read.set()
    for sock in (*sockets.values(), engine_in, engine_out):
        sock.close(linger=0)
    ctx.term()


def _received(sock) -> list:
    import zmq

    from loraserve.engine.utility import OutputDecoder

    decoder, got = OutputDecoder(), []
    while sock.poll(200, zmq.POLLIN):
        got.append(decoder.decode(sock.recv_multipart()))
    return got


def test_an_input_that_does_not_decode_is_answered_and_the_loop_goes_on(engine_proc):
    import msgspec

    from loraserve.engine.utility import InputKind, OutputKind, encode

    proc, core, to_engine, from_engine = engine_proc
    broken = {"request_id": "broken", "prompt_token_ids": "not a list"}
    to_engine.send_multipart([bytes([InputKind.ADD]), msgspec.msgpack.encode(broken)])
    to_engine.send_multipart([bytes([99]), b"\x00"])  # no such kind
    to_engine.send_multipart([b""])  # no frames to speak of
    to_engine.send_multipart(encode(InputKind.ADD, _request("fine", [1, 2, 3])))
    proc._drain_inputs()
    assert core.added == ["fine"]
    (answer,) = _received(from_engine)
    assert answer[0] is OutputKind.OUTPUTS
    (failed,) = answer[1].outputs
    assert failed.request_id == "broken" and failed.finish_reason == FinishReason.ERROR
    assert "invalid request" in failed.error


def test_an_unload_drops_the_adds_of_that_adapter_still_reading(engine_proc):
    from loraserve.engine.utility import InputKind, OutputKind, UtilityCall, encode

    proc, core, to_engine, from_engine = engine_proc
    lora = LoRARequest("reading", 5, "/somewhere")
    to_engine.send_multipart(encode(InputKind.UTILITY, UtilityCall(1, "add_lora", [lora])))
    to_engine.send_multipart(encode(InputKind.UTILITY,
                                    UtilityCall(2, "remove_lora", ["reading"])))
    proc._drain_inputs()
    core.release_read.set()
    replies = {r[1].call_id: r[1] for r in _received(from_engine)
               if r[0] is OutputKind.UTILITY_RESULT}
    assert "'reading' was unloaded while it loaded" in replies[1].error
    assert replies[2].error is None
    assert proc.lora_loader.finished() == []
    assert core.loras_added == []


# ---- torch's CPU threads ----------------------------------------------------------------


@pytest.mark.parametrize("cpus,share,default,env,want", [
    (8, True, 8, {}, 7),  # one core left to the API server
    (8, False, 8, {}, 8),
    (1, True, 1, {}, 1),  # nothing to leave on one core
    (4, True, 64, {}, 3),  # the affinity mask, not the machine, bounds it
    (64, True, 16, {}, 16),  # torch's own default bounds it
    (256, False, 256, {}, MAX_AUTO_THREADS),
    (8, True, 8, {"OMP_NUM_THREADS": "3"}, 3),  # the user's choice wins
    (2, True, 2, {"OMP_NUM_THREADS": "12"}, 12),
    (8, True, 8, {"OMP_NUM_THREADS": "zero"}, 7),  # not a count: ignored
    (8, True, 8, {"OMP_NUM_THREADS": "0"}, 7),
])
def test_thread_count_rule(cpus, share, default, env, want):
    assert pick_num_threads(cpus, share, default, env) == want


def test_the_offline_engine_sets_torch_threads(llama_dir, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        LLM(llama_dir, max_num_seqs=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


# ---- through a server ---------------------------------------------------------------------

PROMPT = "The quick brown fox"
STREAM_TOKENS = 8
ROUNDS = 12
STREAMS_PER_ROUND = 4


@pytest.fixture(scope="module")
def server(llama_dir):
    with ServerProcess(
        [llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
         "--served-model-name", "base"],
        env={"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"},
    ) as srv:
        yield srv


def _stream(server, model: str) -> tuple[str, str]:
    """("full", "") for a whole answer, ("error", message) for an error."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": STREAM_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    finish, usage, error = None, None, None
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      timeout=60) as response:
        if response.status_code != 200:
            response.read()
            return "error", response.json()["error"]["message"]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]["message"]
            for choice in event.get("choices", []):
                finish = choice.get("finish_reason") or finish
            usage = event.get("usage") or usage
    if error is not None:
        return "error", error
    assert finish == "length" and usage["completion_tokens"] == STREAM_TOKENS, (finish, usage)
    return "full", ""


def _held_by_engine(server, name: str) -> list[str]:
    stats = server.get("/v1/engine_stats").json()
    sched = stats["scheduler"]
    where = {"memory": stats["lora_memory_bytes"], "cpu": sched["cpu_lora_adapters"],
             "slot": sched["gpu_lora_adapters"], "running": sched["running_lora_adapters"],
             "waiting": sched["waiting_lora_adapters"]}
    return [place for place, names in where.items() if name in names]


def test_out_of_range_stop_token_is_refused_and_the_server_lives(server):
    engine_pid = server.engine_pid()
    response = server.post("/v1/completions", {
        "model": "base", "prompt": "Hello", "max_tokens": 4,
        "stop_token_ids": [1000000], "min_tokens": 2,
    })
    assert response.status_code == 400, response.text
    assert "1000000" in response.json()["error"]["message"]
    ok = server.post("/v1/completions", {"model": "base", "prompt": "Hello", "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    assert server.engine_pid() == engine_pid


def test_unload_while_requests_stream_leaves_nothing_behind(server, llama_adapters):
    """Streams that chose the adapter just before the unload must not bring it back:
    each gets a whole answer or an error that says so, and nothing of the adapter
    stays in the engine."""
    outcomes: list[tuple[str, str]] = []
    for i in range(ROUNDS):
        name = f"race{i}"
        load = server.post("/v1/load_lora_adapter",
                           {"lora_name": name, "lora_path": llama_adapters["r8"]})
        assert load.status_code == 200, load.text
        results: list[tuple[str, str]] = []
        streams = [threading.Thread(target=lambda n=name, out=results: out.append(
            _stream(server, n))) for _ in range(STREAMS_PER_ROUND)]
        for t in streams:
            t.start()
        # Vary where the unload falls among the streams' start-ups.
        time.sleep(0.004 * (i % 4))
        unload = server.post("/v1/unload_lora_adapter", {"lora_name": name})
        assert unload.status_code == 200, unload.text
        for t in streams:
            t.join(timeout=60)
        assert len(results) == STREAMS_PER_ROUND, server.output()
        for kind, message in results:
            assert kind == "full" or "unloaded" in message or "does not exist" in message, (
                message)
        outcomes += results
        assert _held_by_engine(server, name) == [], f"{name} stayed resident"
    assert {kind for kind, _ in outcomes} <= {"full", "error"}
    health = server.get("/health")
    assert health.status_code == 200
