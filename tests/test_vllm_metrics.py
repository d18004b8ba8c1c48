"""`loraserve serve --metrics-prefix vllm` against what reads vLLM's /metrics: every
series that LoRA-aware routers (the Gateway API Inference Extension's endpoint
picker, llm-d's scheduler) and vLLM's stock Grafana dashboard query is there with
vLLM's name, type and labels, and its values mean what vLLM's do: the scheduler's
running and waiting requests under load, the adapters of lora_requests_info, the
KV cache's block count in cache_config_info, token counts that add up to the
responses' usage, and request phases that add up to the latencies around them."""

from __future__ import annotations

import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServerProcess, wait_until

MODEL = "base"
PER_MODEL = {"model_name", "engine"}
# What the endpoint picker scrapes (its default metric flags) and llm-d's scorers read:
# name -> (type, the labels it has).
ROUTER_FAMILIES = {
    "vllm:num_requests_waiting": ("gauge", PER_MODEL),
    "vllm:num_requests_running": ("gauge", PER_MODEL),
    "vllm:kv_cache_usage_perc": ("gauge", PER_MODEL),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "running_lora_adapters",
                                          "waiting_lora_adapters"}),
}
# The series vLLM's stock Grafana dashboards query (their PromQL selects these sample
# names, filtered by model_name), and the families of those samples with their type.
DASHBOARD_FAMILIES = {
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
}
DASHBOARD_SAMPLES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum", "vllm:iteration_tokens_total_bucket",
    "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]
# Long enough for the test to see two requests run while a third waits.
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    modules = [f"{name}={llama_adapters[path]}"
               for name, path in (("first", "r8"), ("second", "r1"), ("third", "r8_mlp"))]
    with ServerProcess([llama_dir, "--served-model-name", MODEL, "--metrics-prefix", "vllm",
                        "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3",
                        "--max-num-seqs", "2", "--lora-modules", *modules],
                       uvicorn_log_level="info") as srv:
        yield srv


def scrape(server: ServerProcess) -> dict:
    return {f.name: f for f in text_string_to_metric_families(server.get("/metrics").text)}


def value(families: dict, sample_name: str, **labels: str) -> float:
    """The sum of the family's samples of that name whose labels include `labels`."""
    family_name = re.sub(r"_(total|sum|count|bucket)$", "", sample_name)
    family = families.get(family_name) or families[sample_name]
    return sum(s.value for s in family.samples
               if s.name == sample_name and labels.items() <= s.labels.items())


def test_every_series_routers_and_dashboards_read_is_there(server):
    response = server.post("/v1/completions", {"model": "first", "prompt": "Hello",
                                                "max_tokens": 3, "temperature": 0.0})
    assert response.status_code == 200, response.text
    found = scrape(server)
    assert not [name for name in found if name.startswith("loraserve:")]
    for name, (kind, labels) in ROUTER_FAMILIES.items():
        assert found[name].type == kind, name
        assert {frozenset(s.labels) for s in found[name].samples} == {frozenset(labels)}, name
    for name, kind in DASHBOARD_FAMILIES.items():
        assert found[name].type == kind, name
        for sample in found[name].samples:
            assert sample.labels.keys() - {"le", "finished_reason"} == PER_MODEL, sample
            assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
    names = {s.name for f in found.values() for s in f.samples}
    assert not [name for name in DASHBOARD_SAMPLES if name not in names]
    # The finish reasons the dashboard sums by.
    assert {s.labels["finished_reason"] for s in found["vllm:request_success"].samples} >= \
        {"stop", "length", "abort"}
    # Adapters per step, under the same prefix.
    assert found["vllm:step_lora_adapters"].type == "histogram"


def test_cache_config_info_describes_the_kv_cache(server):
    (sample,) = scrape(server)["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "16"  # --block-size's default
    assert sample.labels["enable_prefix_caching"] == "True"
    assert sample.labels["engine"] == "0"
    # Its block count is the engine's: checked against the KV cache usage under load
    # in the next test.
    assert int(sample.labels["num_gpu_blocks"]) >= 1


def _complete(server: ServerProcess, model: str) -> dict:
    body = {"model": model, "prompt": f"Tell {model} a story", "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["usage"]


def test_values_mean_what_vllms_mean_under_load(server):
    before = scrape(server)
    seen: list[dict] = []

    def state() -> tuple:
        found = scrape(server)
        seen.append(found)
        info = found["vllm:lora_requests_info"].samples[0].labels
        return (value(found, "vllm:num_requests_running"),
                value(found, "vllm:num_requests_waiting"),
                info["running_lora_adapters"], info["waiting_lora_adapters"])

    # Two sequences at a time (--max-num-seqs 2) and two adapter slots: the first two
    # run, the third waits for a place.
    with ThreadPoolExecutor(3) as pool:
        running = [pool.submit(_complete, server, name) for name in ("first", "second")]
        assert wait_until(lambda: state()[:3] == (2, 0, "first,second"), 30, 0.05), \
            [state()]
        waiting = pool.submit(_complete, server, "third")
        assert wait_until(lambda: state() == (2, 1, "first,second", "third"), 30, 0.05), \
            [state()]
        loaded = seen[-1]
        usages = [future.result(timeout=300) for future in [*running, waiting]]
    assert wait_until(lambda: state() == (0, 0, "", ""), 15, 0.1), [state()]
    after = seen[-1]
    assert value(after, "vllm:kv_cache_usage_perc") == 0

    def delta(sample_name: str, **labels: str) -> float:
        return value(after, sample_name, **labels) - value(before, sample_name, **labels)

    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == 3 * MAX_TOKENS
    # The KV cache usage is the blocks in use over cache_config_info's block count:
    # a whole number of blocks, as many as the two running requests need.
    blocks = int(loaded["vllm:cache_config_info"].samples[0].labels["num_gpu_blocks"])
    in_use = value(loaded, "vllm:kv_cache_usage_perc") * blocks
    most = sum(math.ceil((u["prompt_tokens"] + MAX_TOKENS) / 16) for u in usages[:2])
    assert in_use == pytest.approx(round(in_use), abs=1e-6) and 2 <= round(in_use) <= most
    # Token counters and per-request sizes add up to the responses' usage.
    assert delta("vllm:prompt_tokens_total") == prompt
    assert delta("vllm:generation_tokens_total") == generated
    assert delta("vllm:iteration_tokens_total_sum") == prompt + generated
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:request_prompt_tokens_sum") == prompt
    assert delta("vllm:request_generation_tokens_sum") == generated
    assert delta("vllm:request_max_num_generation_tokens_sum") == generated
    assert delta("vllm:request_params_max_tokens_sum") == 3 * MAX_TOKENS
    assert delta("vllm:request_params_n_sum") == delta("vllm:request_params_n_count") == 3
    # One first token per request, and a gap before each later token.
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 3
    assert delta("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds_sum"))
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"vllm:request_{phase}_time_seconds_count") == 3, phase
    queue, prefill = delta("vllm:request_queue_time_seconds_sum"), \
        delta("vllm:request_prefill_time_seconds_sum")
    decode, inference = delta("vllm:request_decode_time_seconds_sum"), \
        delta("vllm:request_inference_time_seconds_sum")
    # Running is prefill then decode; the third request waited in the queue.
    assert inference == pytest.approx(prefill + decode) and decode > 0 and queue > 0
    # Each phase lies inside what the client side saw of the same requests.
    assert delta("vllm:time_to_first_token_seconds_sum") >= queue + prefill
    assert delta("vllm:e2e_request_latency_seconds_sum") >= queue + inference
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        decode / (MAX_TOKENS - 1))
    # Steps ran one or two adapters (two slots), never more; some ran both.
    steps = delta("vllm:step_lora_adapters_count")
    assert steps >= MAX_TOKENS
    assert delta("vllm:step_lora_adapters_bucket", le="2.0") == steps
    assert delta("vllm:step_lora_adapters_bucket", le="1.0") < steps
    assert steps < delta("vllm:step_lora_adapters_sum") <= 2 * steps


def test_lora_requests_info_is_there_before_any_request(llama_dir, llama_adapters):
    """A router that finds no series takes the server for one without LoRA."""
    with ServerProcess([llama_dir, "--metrics-prefix", "vllm", "--enable-lora",
                        "--max-loras", "3", "--lora-modules",
                        f"one={llama_adapters['r1']}"]) as fresh:
        info = scrape(fresh)["vllm:lora_requests_info"].samples
    assert [s.labels for s in info] == [{"max_lora": "3", "running_lora_adapters": "",
                                         "waiting_lora_adapters": ""}]
    assert time.time() - 600 < info[0].value <= time.time()
