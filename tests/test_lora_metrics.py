"""vLLM's per-adapter LoRA metrics: the engine's stats count every adapter load
once (from the start of its disk read to the adapter being in the CPU cache) and
name the pinned adapters; a real server's /metrics shows each loaded adapter with
its level and pin, the loaded-adapter counts, and the load-time histogram, and
drops an adapter's series when it leaves a level or is unloaded; and
lora_requests_info reads as LoRA-affinity routers parse it."""

from __future__ import annotations

import concurrent.futures
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServerProcess, wait_until

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.lora.errors import LoRAError
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S, lora_load_time_bucket

NO_LOADS = [0] * (len(LORA_LOAD_TIME_BUCKETS_S) + 1)


# ---- the engine's stats ---------------------------------------------------------


@pytest.fixture()
def llm(llama_dir):
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)


def _use(llm: LLM, lora: LoRARequest, prompt: list[int]) -> None:
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=2),
                 lora)


def num_loads(llm: LLM) -> int:
    return sum(llm.engine.get_stats().lora_load_time_counts)


def test_each_read_from_disk_counts_once(llm, llama_adapters, prompts):
    core = llm.engine
    reqs = {n: LoRARequest(n, i + 1, llama_adapters[n])
            for i, n in enumerate(("r8", "r1", "r16_qv"))}
    stats = core.get_stats()
    assert stats.lora_load_time_counts == NO_LOADS and stats.lora_load_time_sum_s == 0
    core.add_lora(reqs["r8"], pinned=True)  # read on the caller's thread
    _use(llm, reqs["r1"], prompts[0])  # read in the background while the request waits
    # Asking for the stats again and again counts nothing twice.
    assert [sum(core.get_stats().lora_load_time_counts) for _ in range(3)] == [2, 2, 2]
    stats = core.get_stats()
    assert stats.pinned_lora_adapters == ["r8"] and stats.lora_load_time_sum_s > 0
    _use(llm, reqs["r1"], prompts[0])  # in the CPU cache: nothing read
    assert num_loads(llm) == 2
    _use(llm, reqs["r16_qv"], prompts[0])  # two CPU places: r1 goes (r8 is pinned)
    _use(llm, reqs["r1"], prompts[0])  # so r1 is read again
    assert num_loads(llm) == 4


def test_requests_count_as_cache_hits_or_misses_when_they_arrive(llm, llama_adapters, prompts):
    from loraserve.engine.protocol import EngineCoreRequest
    from loraserve.metrics import ServerMetrics

    core = llm.engine
    reqs = {n: LoRARequest(n, i + 1, llama_adapters[n])
            for i, n in enumerate(("r8", "r1", "r16_qv"))}
    params = SamplingParams(temperature=0, max_tokens=2)
    # r8 is read from disk first (a miss), then cached (a hit); the base model is
    # neither; r1 and r16_qv are misses, and r8 then a miss again (two CPU places).
    for i, name in enumerate(("r8", "r8", None, "r1", "r16_qv", "r8")):
        core.add_request(EngineCoreRequest(str(i), list(prompts[0]), params, None,
                                           reqs.get(name)))
        while core.has_unfinished_requests():
            core.step()
    stats = core.get_stats()
    assert (stats.lora_cache_hits, stats.lora_cache_misses) == (1, 4)
    metrics = ServerMetrics("m", max_loras=2)
    for _ in range(2):  # the same totals twice count once
        metrics.record_stats(stats)
    text = metrics.render().decode()
    assert "loraserve:lora_cache_hits_total 1.0" in text
    assert "loraserve:lora_cache_misses_total 4.0" in text


def _wait_for_reads(core) -> None:
    """Until the worker's background reads are done (not yet committed)."""
    store = core.executor.driver.loras.store
    concurrent.futures.wait([future for _, future in store._loading.values()], timeout=60)


def test_a_read_counts_once_it_is_in_the_cache_and_a_failed_one_never(
    llm, llama_adapters, tmp_path
):
    core = llm.engine
    req = LoRARequest("r8", 1, llama_adapters["r8"])
    # A runtime add reads in the background; the engine commits it from its loop.
    core.start_add_lora(req)
    core.start_add_lora(LoRARequest("r1", 2, llama_adapters["r1"]))
    _wait_for_reads(core)
    core.remove_lora("r1")  # its add is dropped
    assert num_loads(llm) == 0
    assert [(r.lora_name, e) for r, e in core.poll_lora_adds()] == [("r8", None)]
    assert num_loads(llm) == 1
    with pytest.raises(LoRAError):
        core.add_lora(LoRARequest("missing", 3, str(tmp_path / "missing")))
    assert num_loads(llm) == 1


def test_the_load_time_runs_from_the_start_of_the_read_to_the_cache(llm, llama_adapters):
    core = llm.engine
    req = LoRARequest("r8", 1, llama_adapters["r8"])
    started = time.monotonic()
    core.start_add_lora(req)
    _wait_for_reads(core)
    time.sleep(0.3)  # the add waits for the engine loop: still part of the load
    assert core.poll_lora_adds() == [(req, None)]
    elapsed = time.monotonic() - started
    stats = core.get_stats()
    assert 0.3 <= stats.lora_load_time_sum_s <= elapsed
    bucket = lora_load_time_bucket(stats.lora_load_time_sum_s)
    assert stats.lora_load_time_counts == [int(i == bucket) for i in range(len(NO_LOADS))]


# ---- a real server's /metrics -----------------------------------------------------


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    pinned = json.dumps({"name": "pinned", "path": llama_adapters["r1"], "pinned": True})
    with ServerProcess(
        [
            llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4",
            "--served-model-name", "base",
            "--lora-modules", f"static={llama_adapters['r8']}", pinned,
        ],
        env={"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    ) as srv:
        yield srv


def scrape(server: ServerProcess) -> dict:
    response = httpx.get(server.url + "/metrics", timeout=10)
    assert response.status_code == 200
    return {f.name: f for f in text_string_to_metric_families(response.text)}


def loaded(families: dict) -> set[tuple[str, str, str]]:
    return {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"])
            for s in families["loraserve:lora_adapter_loaded"].samples if s.value == 1}


def gauge(families: dict, name: str) -> float:
    (sample,) = families[name].samples
    return sample.value


def load_histogram(families: dict) -> dict[str, float]:
    family = families["loraserve:lora_adapter_load_seconds"]
    assert family.type == "histogram"
    return {s.labels.get("le", s.name.rsplit("_", 1)[1]): s.value for s in family.samples}


def wait_for_metrics(server: ServerProcess, want_loaded: set, num_gpu: int,
                     num_cpu: int) -> dict:
    """The engine sends its stats a few times a second: wait for the state to show."""
    found: dict = {}

    def shows() -> bool:
        found.update(scrape(server))
        return (loaded(found) == want_loaded
                and gauge(found, "loraserve:num_gpu_loaded_lora_adapters") == num_gpu
                and gauge(found, "loraserve:num_cpu_loaded_lora_adapters") == num_cpu)

    assert wait_until(shows, 15, 0.1), (loaded(found), server.output())
    return found


def test_metrics_follow_the_adapters_of_a_running_server(server, llama_adapters):
    # At start-up both static adapters are read and take the two slots.
    wait_for_metrics(server, {("static", "gpu", "false"), ("pinned", "gpu", "true")}, 2, 2)

    response = server.post("/v1/load_lora_adapter",
                           {"lora_name": "runtime", "lora_path": llama_adapters["r16_qv"]})
    assert response.status_code == 200, response.text
    # The new adapter takes the slot of the unpinned one, which stays in CPU memory.
    wait_for_metrics(server, {("static", "cpu", "false"), ("pinned", "gpu", "true"),
                              ("runtime", "gpu", "false")}, 2, 3)

    response = server.post("/v1/completions", {"model": "static", "prompt": "Hello",
                                               "max_tokens": 2, "temperature": 0.0})
    assert response.status_code == 200, response.text
    found = wait_for_metrics(server, {("static", "gpu", "false"), ("pinned", "gpu", "true"),
                                      ("runtime", "cpu", "false")}, 2, 3)
    # lora_requests_info keeps vLLM's labels beside the new metrics.
    info = found["loraserve:lora_requests_info"].samples
    assert info and {s.labels["max_lora"] for s in info} == {"2"}
    assert set(info[0].labels) == {"max_lora", "waiting_lora_adapters",
                                   "running_lora_adapters"}

    response = server.post("/v1/unload_lora_adapter", {"lora_name": "runtime"})
    assert response.status_code == 200, response.text
    found = wait_for_metrics(server, {("static", "gpu", "false"), ("pinned", "gpu", "true")},
                             2, 2)
    assert not [s for s in found["loraserve:lora_adapter_loaded"].samples
                if s.labels["adapter_name"] == "runtime"]

    # Three reads from disk (two static, one at run time); the request read nothing.
    histogram = load_histogram(found)
    assert histogram["count"] == 3 and histogram["+Inf"] == 3 and histogram["sum"] > 0
    cumulative = [histogram[str(bound)] for bound in LORA_LOAD_TIME_BUCKETS_S]
    assert cumulative == sorted(cumulative) and cumulative[-1] <= 3



# ---- the contract LoRA-affinity routers read --------------------------------------


def router_view(text: str) -> dict:
    """lora_requests_info read the way LoRA-affinity routers read it (the Gateway
    API inference extension's model-server protocol, vLLM production-stack): of the
    series, the one with the largest value (its update time) is the current state;
    max_lora is an integer; the adapter lists are comma-separated, empty for none."""
    (family,) = [f for f in text_string_to_metric_families(text)
                 if f.name == "loraserve:lora_requests_info"]
    latest = max(family.samples, key=lambda s: s.value)

    def names(label: str) -> set[str]:
        value = latest.labels[label]
        return set(value.split(",")) if value else set()

    return {"labels": set(latest.labels), "updated": latest.value,
            "max_lora": int(latest.labels["max_lora"]),
            "running": names("running_lora_adapters"),
            "waiting": names("waiting_lora_adapters")}


@pytest.fixture(scope="module")
def three_adapter_server(llama_dir, llama_adapters):
    """Two device slots, three adapters, none pinned."""
    modules = [f"{name}={llama_adapters[path]}"
               for name, path in (("first", "r8"), ("second", "r1"), ("third", "r8_mlp"))]
    with ServerProcess([llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3",
                        "--lora-modules", *modules]) as srv:
        yield srv


def test_lora_requests_info_reads_as_routers_parse_it(three_adapter_server):
    server = three_adapter_server

    def long_request(model: str) -> None:
        body = {"model": model, "prompt": "Hello", "max_tokens": 500, "temperature": 0.0,
                "ignore_eos": True}
        response = server.post("/v1/completions", body)
        assert response.status_code == 200, response.text

    started = time.time()
    views: list[dict] = []

    def shows_all_three() -> bool:
        views.append(router_view(server.get("/metrics").text))
        return views[-1]["running"] == {"first", "second"} and views[-1]["waiting"] == {"third"}

    # Two slots (--max-loras 2): two adapters run, the third one's request waits.
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(long_request, name) for name in ("first", "second")]
        assert wait_until(lambda: router_view(server.get("/metrics").text)["running"]
                          == {"first", "second"}, 30, 0.05), views[-3:]
        waiting = pool.submit(long_request, "third")
        assert wait_until(shows_all_three, 30, 0.05), views[-3:]
        for future in [*running, waiting]:
            future.result(timeout=120)
    view = views[-1]
    assert view["labels"] == {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert view["max_lora"] == 2
    assert started - 1 <= view["updated"] <= time.time()
    assert wait_until(lambda: not router_view(server.get("/metrics").text)["running"], 15, 0.1)
    # Of all the label sets seen above, only the current one is still exported.
    (family,) = [f for f in text_string_to_metric_families(server.get("/metrics").text)
                 if f.name == "loraserve:lora_requests_info"]
    assert len(family.samples) == 1, family.samples
