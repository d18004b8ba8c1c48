"""Many requests at once against a real server: mixed streaming and not,
completions and chat, over more adapters than --max-cpu-loras, while adapters
are loaded and unloaded at run time. No request is lost or hangs, and every
greedy answer equals the same request run alone on the same server."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
from fault_utils import (
    Reply,
    assert_complete,
    call,
    chat_body,
    completion_body,
    engine_stats,
    outcome,
    start_server,
    token_ids,
    wait_engine_idle,
)
from serve_utils import wait_until
from utils import make_peft_adapter

MAX_TOKENS = 8
# Longer, so that requests for an adapter are still running when it is unloaded.
RACING_MAX_TOKENS = 160
PROMPTS = ["The quick brown fox", "Once upon a time there was a tiny model"]
CHAT_CONTENT = "What is the capital of France?"
STABLE = ["base", "s0", "s1", "s2", "s3"]
CHURN = ["c0", "c1"]
NUM_JOBS = 60
CHURN_CYCLES = 3
PHASE_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def churn_paths(tmp_path_factory, llama_dir) -> dict[str, str]:
    root = tmp_path_factory.mktemp("load_adapters")
    return {
        "c0": make_peft_adapter(llama_dir, root / "c0", r=4, alpha=8, seed=21),
        "c1": make_peft_adapter(llama_dir, root / "c1", r=8, alpha=4,
                                target_modules=("q_proj", "o_proj", "down_proj"), seed=22),
    }


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    # Four start-up adapters, two more at run time, three fit in CPU memory and two
    # in device slots: the run loads adapters from disk and swaps slots throughout.
    stable = [f"s{i}={llama_adapters[key]}"
              for i, key in enumerate(["r8", "r16_qv", "r1", "r8_mlp"])]
    with start_server(
        [llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
         "--max-cpu-loras", "3", "--max-num-seqs", "16", "--lora-modules", *stable],
        env={"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ) as srv:
        yield srv


def body_for(model: str, variant: int, max_tokens: int, stream: bool, n: int = 1) -> dict:
    """variant 0 and 1: a completion of PROMPTS[variant]; 2: a chat."""
    if variant == 2:
        return chat_body(model, CHAT_CONTENT, max_tokens, stream, n=n)
    return completion_body(model, PROMPTS[variant], max_tokens, stream, n=n)


def alone(server, model: str, variant: int, max_tokens: int) -> list[int]:
    """The greedy tokens of one request with nothing else running."""
    reply = call(server.url, _path(variant), body_for(model, variant, max_tokens, False))
    return token_ids(reply)[0]


def _path(variant: int) -> str:
    return "/v1/chat/completions" if variant == 2 else "/v1/completions"


def load(server, name: str, path: str) -> Reply:
    return call(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def unload(server, name: str) -> Reply:
    return call(server.url, "/v1/unload_lora_adapter", {"lora_name": name})


@pytest.fixture(scope="module")
def reference(server) -> dict[tuple[str, int], list[int]]:
    """Each distinct request run alone, one at a time, before the load."""
    return {(m, v): alone(server, m, v, MAX_TOKENS) for m in STABLE for v in range(3)}


def test_the_adapters_change_the_output(reference):
    # Otherwise equal outputs would not show that each request got its own adapter.
    for variant in range(3):
        outputs = {tuple(reference[(m, variant)]) for m in STABLE}
        assert len(outputs) == len(STABLE), variant


def _jobs() -> list[tuple[str, int, bool, int]]:
    """(model, variant, stream, n): every combination, each several times, in an
    order that interleaves them."""
    jobs = []
    for i in range(NUM_JOBS):
        variant = (i // len(STABLE)) % 3
        n = 2 if i % 4 == 3 and variant != 2 else 1
        jobs.append((STABLE[i % len(STABLE)], variant, (i // 15) % 2 == 0, n))
    return jobs


def _churn(server, churn_paths, pool: ThreadPoolExecutor, racing: list, admin: list,
           stop: threading.Event) -> None:
    """Load an adapter, send it requests, unload it while they run, send one more
    after; then the next adapter, for CHURN_CYCLES rounds."""
    for cycle in range(CHURN_CYCLES):
        for name in CHURN:
            if stop.is_set():
                return
            admin.append((f"load {name} #{cycle}", load(server, name, churn_paths[name])))
            for variant, stream in ((0, True), (2, False), (1, True)):
                body = body_for(name, variant, RACING_MAX_TOKENS, stream)
                racing.append((name, variant,
                               pool.submit(call, server.url, _path(variant), body)))
            # Unload while they run (the engine shows the adapter in use), so that
            # the unload really races them.
            wait_until(lambda n=name: n in engine_stats(server)["scheduler"][
                "running_lora_adapters"], 30)
            admin.append((f"unload {name} #{cycle}", unload(server, name)))
            body = body_for(name, 0, RACING_MAX_TOKENS, False)
            racing.append((name, 0, pool.submit(call, server.url, "/v1/completions", body)))


def test_concurrent_mixed_load_with_adapter_churn(server, churn_paths, reference):
    jobs = _jobs()
    racing: list = []
    admin: list[tuple[str, Reply]] = []
    stop = threading.Event()
    with ThreadPoolExecutor(NUM_JOBS + 4 * len(CHURN) * CHURN_CYCLES) as pool:
        futures = [pool.submit(call, server.url, _path(v), body_for(m, v, MAX_TOKENS, s, n))
                   for m, v, s, n in jobs]
        churner = threading.Thread(
            target=_churn, args=(server, churn_paths, pool, racing, admin, stop), daemon=True)
        churner.start()
        churner.join(PHASE_TIMEOUT_S)
        stop.set()
        assert not churner.is_alive(), "loading and unloading adapters hung"
        _, not_done = wait(futures + [f for _, _, f in racing], timeout=PHASE_TIMEOUT_S)
        # Nothing is lost or hung: every request has its answer (call() gives up,
        # with a ReadTimeout, on a request that takes more than two minutes).
        assert not not_done, f"{len(not_done)} requests never finished"

    mismatches, failures = [], []
    for (model, variant, stream, n), future in zip(jobs, futures, strict=True):
        reply = future.result()
        try:
            assert_complete(reply)
        except AssertionError:
            failures.append(((model, variant, stream, n), reply.describe()))
            continue
        got = token_ids(reply)
        assert sorted(got) == list(range(n)), reply.describe()
        if any(ids != reference[(model, variant)] for ids in got.values()):
            mismatches.append(((model, variant, stream, n), got, reference[(model, variant)]))
    assert not failures, failures
    assert not mismatches, mismatches

    # Every load and unload of the churn succeeded.
    assert all(reply.status == 200 for _, reply in admin), \
        [(what, reply.describe()) for what, reply in admin if reply.status != 200]
    # A request that raced its adapter's unload was answered in full or refused
    # with a clear 4xx, never a 5xx or a cut stream.
    completed: dict[tuple[str, int], list[list[int]]] = {}
    for name, variant, future in racing:
        reply = future.result()
        try:
            result = outcome(reply, error_codes={400, 404})
        except AssertionError as exc:
            pytest.fail(f"request for {name} during its unload: {exc}")
        if result == "complete":
            completed.setdefault((name, variant), []).append(token_ids(reply)[0])
    # A full answer has that adapter's tokens: the same request, run alone now.
    for name in {name for name, _ in completed}:
        assert load(server, name, churn_paths[name]).status == 200
        for (other, variant), outputs in completed.items():
            if other == name:
                expected = alone(server, name, variant, RACING_MAX_TOKENS)
                assert all(ids == expected for ids in outputs), (name, variant)
        assert unload(server, name).status == 200

    # Nothing is left behind in the engine, and it still serves.
    assert wait_engine_idle(server), engine_stats(server)
    stats = engine_stats(server)
    scheduler = stats["scheduler"]
    assert len(scheduler["cpu_lora_adapters"]) <= 3 and len(scheduler["gpu_lora_adapters"]) <= 2
    # An unloaded adapter is gone from the engine for good: no request that raced
    # the unload brought it back into memory.
    held = set(scheduler["cpu_lora_adapters"]) | set(scheduler["gpu_lora_adapters"]) | \
        set(stats["lora_memory_bytes"])
    assert not held & set(CHURN), stats
    names = {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert set(STABLE) <= names and not set(CHURN) & names
    for model in STABLE:
        assert alone(server, model, 0, MAX_TOKENS) == reference[(model, 0)]
