"""Prometheus metrics: names with the `loraserve:` prefix (vLLM's `vllm:` behind
--metrics-prefix vllm, with nothing else different), lora_requests_info as
DESIGN.md defines it, adapter residency (vLLM's lora_adapter_loaded and the
loaded-adapter counts), adapter load times, adapters per step, the per-request
phases, and output that prometheus_client parses."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.protocol import RequestTimes, SchedulerStats
from loraserve.engine.request_stats import FinishedRequest, IterationStats, RequestTimeline
from loraserve.engine.step_stats import STEP_LORA_ADAPTER_BUCKETS, StepLoRACounter
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S, lora_load_time_bucket
from loraserve.metrics import ServerMetrics, token_count_buckets

# prometheus_client's own collectors of the process, exported under their own names.
PROCESS_PREFIXES = ("process_", "python_")


def families(metrics: ServerMetrics) -> dict:
    text = metrics.render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def finished(reason: str = "stop", e2e_s: float = 0.5, **fields) -> FinishedRequest:
    values = {"num_prompt_tokens": 7, "num_generation_tokens": 4, "max_tokens": 16} | fields
    return FinishedRequest(finish_reason=reason, e2e_s=e2e_s, **values)


def test_every_metric_has_the_prefix_and_parses():
    metrics = ServerMetrics("m", max_loras=2)
    metrics.record_iteration(IterationStats(num_prompt_tokens=7, num_generation_tokens=1,
                                            time_to_first_token_s=[0.05]))
    metrics.record_iteration(IterationStats(
        num_generation_tokens=3, inter_token_latency_s=[0.01],
        finished_requests=[finished("stop"), finished("length")]))
    found = families(metrics)
    ours = [name for name in found if not name.startswith(PROCESS_PREFIXES)]
    assert ours and all(name.startswith("loraserve:") for name in ours)
    sample = {s.name: s.value for f in found.values() for s in f.samples}
    assert sample['loraserve:prompt_tokens_total'] == 7
    assert sample['loraserve:generation_tokens_total'] == 4
    assert sample['loraserve:time_to_first_token_seconds_count'] == 1
    assert sample['loraserve:inter_token_latency_seconds_count'] == 1
    assert sample['loraserve:time_per_output_token_seconds_sum'] == 0.01
    assert sample['loraserve:e2e_request_latency_seconds_count'] == 2
    # Each message's prompt and generated tokens: 7 + 1, then 3.
    assert sample['loraserve:iteration_tokens_total_count'] == 2
    assert sample['loraserve:iteration_tokens_total_sum'] == 11
    counted = {s.labels["finished_reason"]: s.value
               for s in found["loraserve:request_success"].samples if s.name.endswith("_total")}
    # vLLM's reasons all have a series from the start.
    assert counted == {"stop": 1, "length": 1, "abort": 0, "error": 0}


def test_scheduler_stats_feed_the_gauges():
    metrics = ServerMetrics("m", max_loras=2)
    before = time.time()
    metrics.record_stats(SchedulerStats(
        num_running=3, num_waiting=2, kv_cache_usage=0.25,
        running_lora_adapters=["a", "b"], waiting_lora_adapters=["c"],
        gpu_lora_adapters=["a", "b"], cpu_lora_adapters=["a", "b", "c"], num_preemptions=4,
    ))
    found = families(metrics)
    value = lambda name: found[name].samples[0].value  # noqa: E731
    assert value("loraserve:num_requests_running") == 3
    assert value("loraserve:num_requests_waiting") == 2
    assert value("loraserve:kv_cache_usage_perc") == 0.25
    info = found["loraserve:lora_requests_info"].samples
    assert len(info) == 1
    assert info[0].labels == {"max_lora": "2", "running_lora_adapters": "a,b",
                              "waiting_lora_adapters": "c"}
    assert info[0].value >= before
    loaded = {(s.labels["adapter_name"], s.labels["level"])
              for s in found["loraserve:lora_adapter_loaded"].samples}
    assert loaded == {("a", "gpu"), ("b", "gpu"), ("c", "cpu")}


def test_lora_requests_info_keeps_only_the_current_series():
    """Adapters coming and going must not leave a series per combination behind."""
    metrics = ServerMetrics("m", max_loras=2)
    for i in range(200):
        metrics.record_stats(SchedulerStats(running_lora_adapters=[f"a{i}"],
                                            waiting_lora_adapters=[f"b{i}", f"c{i}"]))
    metrics.record_stats(SchedulerStats(running_lora_adapters=["last"]))
    metrics.record_stats(SchedulerStats(running_lora_adapters=["last"]))
    (info,) = families(metrics)["loraserve:lora_requests_info"].samples
    assert info.labels == {"max_lora": "2", "running_lora_adapters": "last",
                           "waiting_lora_adapters": ""}
    assert b"a0" not in metrics.render() and b"a199" not in metrics.render()


def test_residency_follows_evictions_and_preemptions_count_once():
    metrics = ServerMetrics("m", max_loras=1)
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["a"], cpu_lora_adapters=["a"],
                                        num_preemptions=2))
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["b"], cpu_lora_adapters=["b"],
                                        num_preemptions=2))
    found = families(metrics)
    loaded = {(s.labels["adapter_name"], s.labels["level"])
              for s in found["loraserve:lora_adapter_loaded"].samples}
    assert loaded == {("b", "gpu")}
    total = [s for s in found["loraserve:num_preemptions"].samples if s.name.endswith("_total")]
    assert total[0].value == 2


def test_each_server_has_its_own_registry():
    one, two = ServerMetrics("a", 1), ServerMetrics("b", 1)
    one.record_iteration(IterationStats(num_prompt_tokens=5))
    assert b'model_name="a"' in one.render() and b'model_name="a"' not in two.render()


def test_grafana_dashboard_uses_only_real_metrics():
    import json
    import re
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "grafana" / "loraserve_dashboard.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"loraserve:[a-z0-9_]+", e)}
    metrics = ServerMetrics("m", 1)
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["a"]))
    metrics.record_iteration(IterationStats(finished_requests=[finished()]))
    exposed = {s.name for f in families(metrics).values() for s in f.samples}
    assert used and used <= exposed, used - exposed


def test_lora_metrics_only_with_lora():
    metrics = ServerMetrics("m", max_loras=None)
    metrics.record_stats(SchedulerStats(num_running=1))
    names = {n for n in families(metrics) if not n.startswith(PROCESS_PREFIXES)}
    assert "loraserve:num_requests_running" in names
    assert not {n for n in names if "lora" in n.split(":", 1)[1]}


def loaded_series(found: dict) -> set[tuple[str, str, str]]:
    return {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"])
            for s in found["loraserve:lora_adapter_loaded"].samples if s.value == 1}


def test_each_loaded_adapter_has_one_series_at_its_fastest_level():
    metrics = ServerMetrics("m", max_loras=2)
    metrics.record_stats(SchedulerStats(
        gpu_lora_adapters=["a", "d"], cpu_lora_adapters=["a", "b", "c"],
        pinned_lora_adapters=["b", "d"],
    ))
    found = families(metrics)
    # d holds a slot after the CPU cache let it go (a running request still uses it).
    assert loaded_series(found) == {("a", "gpu", "false"), ("b", "cpu", "true"),
                                    ("c", "cpu", "false"), ("d", "gpu", "true")}
    assert len(found["loraserve:lora_adapter_loaded"].samples) == 4
    assert found["loraserve:num_gpu_loaded_lora_adapters"].samples[0].value == 2
    assert found["loraserve:num_cpu_loaded_lora_adapters"].samples[0].value == 3


def test_loaded_series_follow_slot_moves_pins_and_unloads():
    metrics = ServerMetrics("m", max_loras=1)
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["a"], cpu_lora_adapters=["a", "b"]))
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["b"], cpu_lora_adapters=["a", "b"],
                                        pinned_lora_adapters=["b"]))
    found = families(metrics)
    # No series stays behind at the old level or with the old pin.
    assert {(s.labels["adapter_name"], s.labels["level"], s.labels["pinned"])
            for s in found["loraserve:lora_adapter_loaded"].samples} == {
        ("a", "cpu", "false"), ("b", "gpu", "true")}
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["b"], cpu_lora_adapters=["b"],
                                        pinned_lora_adapters=["b"]))
    found = families(metrics)
    assert [s.labels["adapter_name"] for s in found["loraserve:lora_adapter_loaded"].samples] \
        == ["b"]
    assert found["loraserve:num_cpu_loaded_lora_adapters"].samples[0].value == 1


def load_time_samples(metrics: ServerMetrics) -> dict:
    family = families(metrics)["loraserve:lora_adapter_load_seconds"]
    assert family.type == "histogram"
    return {(s.name.rsplit("_", 1)[1], s.labels.get("le")): s.value for s in family.samples}


def test_load_times_count_each_load_once_however_often_stats_arrive():
    metrics = ServerMetrics("m", max_loras=2)
    assert load_time_samples(metrics)[("count", None)] == 0
    counts = [0] * (len(LORA_LOAD_TIME_BUCKETS_S) + 1)
    counts[lora_load_time_bucket(0.02)] += 1
    stats = SchedulerStats(lora_load_time_counts=list(counts), lora_load_time_sum_s=0.02)
    # Stats more often than loads: the same totals again and again.
    for _ in range(3):
        metrics.record_stats(stats)
    samples = load_time_samples(metrics)
    assert samples[("count", None)] == 1 and samples[("sum", None)] == 0.02
    assert samples[("bucket", "0.01")] == 0 and samples[("bucket", "0.025")] == 1
    # Stats less often than loads: three more loads between two messages.
    for seconds in (0.3, 45.0, 75.0):
        counts[lora_load_time_bucket(seconds)] += 1
    metrics.record_stats(SchedulerStats(lora_load_time_counts=counts,
                                        lora_load_time_sum_s=120.32))
    samples = load_time_samples(metrics)
    assert samples[("count", None)] == 4 and samples[("sum", None)] == 120.32
    assert samples[("bucket", "0.25")] == 1 and samples[("bucket", "0.5")] == 2
    assert samples[("bucket", "30.0")] == 2 and samples[("bucket", "60.0")] == 3
    assert samples[("bucket", "+Inf")] == 4
    # A message without LoRA totals (none yet) leaves them as they are.
    metrics.record_stats(SchedulerStats())
    assert load_time_samples(metrics)[("count", None)] == 4


def test_load_time_buckets_span_10ms_to_60s():
    assert LORA_LOAD_TIME_BUCKETS_S[0] == 0.01 and LORA_LOAD_TIME_BUCKETS_S[-1] == 60.0
    assert list(LORA_LOAD_TIME_BUCKETS_S) == sorted(set(LORA_LOAD_TIME_BUCKETS_S))
    # A load that takes exactly a bound is in that bound's bucket (Prometheus' le).
    assert lora_load_time_bucket(0.01) == 0 and lora_load_time_bucket(0.0100001) == 1
    assert lora_load_time_bucket(61.0) == len(LORA_LOAD_TIME_BUCKETS_S)


# ---- --metrics-prefix vllm: vLLM's names, nothing else different ------------------


def _fed(prefix: str) -> ServerMetrics:
    """A server's metrics after the same traffic, whatever the prefix."""
    from loraserve.config import CacheConfig
    from loraserve.metrics import cache_config_labels

    metrics = ServerMetrics("m", max_loras=2, prefix=prefix, max_model_len=64)
    metrics.set_cache_config(cache_config_labels(CacheConfig(block_size=16), 40))
    metrics.record_stats(SchedulerStats(
        num_running=1, num_waiting=1, kv_cache_usage=0.5, running_lora_adapters=["a"],
        waiting_lora_adapters=["b"], gpu_lora_adapters=["a"], cpu_lora_adapters=["a", "b"],
        num_preemptions=1, lora_load_time_counts=[1] + [0] * len(LORA_LOAD_TIME_BUCKETS_S),
        lora_load_time_sum_s=0.01, prefix_cache_tokens=(32, 16),
        step_lora_adapter_counts=[0, 3] + [0] * (len(STEP_LORA_ADAPTER_BUCKETS) - 1),
        step_lora_adapters_sum=3))
    metrics.record_iteration(IterationStats(
        num_prompt_tokens=7, num_generation_tokens=2, time_to_first_token_s=[0.2],
        inter_token_latency_s=[0.01],
        finished_requests=[finished(queue_s=0.1, prefill_s=0.1, decode_s=0.01,
                                    inference_s=0.11, mean_time_per_output_token_s=0.01)],
        finished_parents=[(1, 2)]))
    return metrics


def _by_suffix(metrics: ServerMetrics, prefix: str) -> dict:
    """Family name without the prefix -> (type, {(sample name without prefix, labels):
    value}), leaving out the values that are clock readings."""
    found = {}
    for name, family in families(metrics).items():
        if name.startswith(PROCESS_PREFIXES):
            continue
        assert name.startswith(prefix), name
        samples = {}
        for s in family.samples:
            timed = s.name.endswith("_created") or name.endswith("lora_requests_info")
            samples[(s.name.removeprefix(prefix), tuple(sorted(s.labels.items())))] = (
                None if timed else s.value)
        found[name.removeprefix(prefix)] = (family.type, samples)
    return found


def test_vllm_prefix_changes_the_names_and_nothing_else():
    ours, vllms = _by_suffix(_fed("loraserve"), "loraserve:"), _by_suffix(_fed("vllm"), "vllm:")
    assert ours == vllms
    # What routers and vLLM's dashboards read, under vLLM's names and types.
    for suffix, kind in [("num_requests_running", "gauge"), ("num_requests_waiting", "gauge"),
                         ("kv_cache_usage_perc", "gauge"), ("lora_requests_info", "gauge"),
                         ("cache_config_info", "gauge"), ("prompt_tokens", "counter"),
                         ("generation_tokens", "counter"), ("request_success", "counter"),
                         ("num_preemptions", "counter"), ("prefix_cache_queries", "counter"),
                         ("prefix_cache_hits", "counter"),
                         ("time_to_first_token_seconds", "histogram"),
                         ("inter_token_latency_seconds", "histogram"),
                         ("time_per_output_token_seconds", "histogram"),
                         ("e2e_request_latency_seconds", "histogram"),
                         ("iteration_tokens_total", "histogram"),
                         ("request_queue_time_seconds", "histogram"),
                         ("request_prefill_time_seconds", "histogram"),
                         ("request_decode_time_seconds", "histogram"),
                         ("request_inference_time_seconds", "histogram"),
                         ("request_prompt_tokens", "histogram"),
                         ("request_generation_tokens", "histogram"),
                         ("request_params_n", "histogram"),
                         ("request_params_max_tokens", "histogram")]:
        assert vllms[suffix][0] == kind, suffix


def test_an_unknown_prefix_is_refused():
    with pytest.raises(ValueError, match="vllm"):
        ServerMetrics("m", 1, prefix="sglang")


def test_cache_config_info_is_one_series_of_value_1():
    from loraserve.config import CacheConfig
    from loraserve.metrics import cache_config_labels

    metrics = ServerMetrics("m", None, prefix="vllm")
    config = CacheConfig(block_size=32, enable_prefix_caching=False)
    metrics.set_cache_config(cache_config_labels(config, 100))
    metrics.set_cache_config(cache_config_labels(config, 123))  # a second call replaces
    (sample,) = families(metrics)["vllm:cache_config_info"].samples
    assert sample.value == 1
    assert sample.labels["block_size"] == "32" and sample.labels["num_gpu_blocks"] == "123"
    assert sample.labels["enable_prefix_caching"] == "False" and sample.labels["engine"] == "0"


# ---- distinct adapters per step ----------------------------------------------------


def step_histogram(metrics: ServerMetrics) -> dict:
    family = families(metrics)["loraserve:step_lora_adapters"]
    assert family.type == "histogram" and not any(s.labels.keys() - {"le"}
                                                   for s in family.samples)
    return {s.labels.get("le", s.name.rsplit("_", 1)[1]): s.value for s in family.samples}


def test_step_lora_adapters_counts_distinct_adapters_of_each_step():
    counter = StepLoRACounter()
    for names in (set(), {"a"}, {"a", "b"}, {"b", "c"}, {"a", "b", "c"}, {f"x{i}" for i in
                                                                          range(600)}):
        counter.record(names)
    counts, total = counter.totals()
    metrics = ServerMetrics("m", max_loras=4)
    assert step_histogram(metrics)["count"] == 0
    for _ in range(3):  # the same totals again and again count once
        metrics.record_stats(SchedulerStats(step_lora_adapter_counts=counts,
                                            step_lora_adapters_sum=total))
    histogram = step_histogram(metrics)
    assert histogram["count"] == 6 and histogram["sum"] == 0 + 1 + 2 + 2 + 3 + 600
    # Cumulative, with Prometheus' le: a step of exactly 2 adapters is in le="2.0".
    assert [histogram[le] for le in ("0.0", "1.0", "2.0", "4.0", "512.0", "+Inf")] == \
        [1, 2, 4, 5, 5, 6]
    assert [float(b) for b in STEP_LORA_ADAPTER_BUCKETS] == \
        [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


# ---- per-request phases and sizes -------------------------------------------------


def test_a_timeline_gives_vllms_intervals():
    """Queue: queued to first scheduled; prefill: to the first token; decode: first to
    last token; inference: scheduled to last token; all in the engine's clock. TTFT,
    the gaps between tokens and e2e in the front end's."""
    stats = IterationStats()
    timeline = RequestTimeline(arrival=100.0, num_prompt_tokens=5, max_tokens=10)
    timeline.add_tokens(1, RequestTimes(queued=10.0, scheduled=12.0), 15.0, 101.0, stats)
    timeline.add_tokens(0, None, 15.5, 101.2, stats)  # a message without a token
    timeline.add_tokens(1, None, 16.0, 101.5, stats)
    timeline.add_tokens(2, None, 19.0, 102.5, stats)
    done = timeline.finish("length", 103.0)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (5, 4)
    assert stats.time_to_first_token_s == [1.0] and stats.inter_token_latency_s == [0.5, 1.0]
    assert (done.queue_s, done.prefill_s, done.decode_s, done.inference_s) == (2, 3, 4, 7)
    assert done.mean_time_per_output_token_s == 4 / 3 and done.e2e_s == 3.0
    assert (done.num_prompt_tokens, done.num_generation_tokens, done.max_tokens) == (5, 4, 10)


def test_a_request_without_tokens_has_no_phases():
    done = RequestTimeline(arrival=1.0, num_prompt_tokens=3, max_tokens=None).finish(
        "error", 1.5)
    assert done.queue_s is None and done.decode_s is None
    assert done.mean_time_per_output_token_s is None and done.e2e_s == 0.5
    metrics = ServerMetrics("m", None)
    metrics.record_iteration(IterationStats(finished_requests=[done]))
    sample = {s.name: s.value for f in families(metrics).values() for s in f.samples}
    assert sample["loraserve:e2e_request_latency_seconds_count"] == 1
    assert sample["loraserve:request_queue_time_seconds_count"] == 0
    assert sample["loraserve:request_params_max_tokens_count"] == 0
    assert sample["loraserve:request_prompt_tokens_sum"] == 3


def test_one_token_has_no_time_per_output_token():
    stats = IterationStats()
    timeline = RequestTimeline(arrival=0.0, num_prompt_tokens=2, max_tokens=1)
    timeline.add_tokens(1, RequestTimes(1.0, 1.5), 2.0, 0.5, stats)
    done = timeline.finish("length", 0.6)
    assert done.decode_s == 0 and done.mean_time_per_output_token_s == 0.0


def test_finished_requests_feed_the_per_request_histograms():
    metrics = ServerMetrics("m", None, max_model_len=100)
    metrics.record_iteration(IterationStats(
        finished_requests=[
            finished(num_prompt_tokens=3, num_generation_tokens=10, max_tokens=10,
                     queue_s=0.5, prefill_s=0.25, decode_s=1.0, inference_s=1.25,
                     mean_time_per_output_token_s=1 / 9),
            finished(num_prompt_tokens=4, num_generation_tokens=2, max_tokens=20,
                     queue_s=0.0, prefill_s=0.5, decode_s=0.25, inference_s=0.75,
                     mean_time_per_output_token_s=0.25)],
        finished_parents=[(2, 10)]))
    sample = {s.name.removeprefix("loraserve:") + str(s.labels.get("le", "")): s.value
              for f in families(metrics).values() for s in f.samples}
    assert sample["request_prompt_tokens_sum"] == 7
    assert sample["request_generation_tokens_sum"] == 12
    assert sample["request_generation_tokens_bucket2.0"] == 1
    assert sample["request_params_max_tokens_sum"] == 30
    assert sample["request_queue_time_seconds_sum"] == 0.5
    assert sample["request_prefill_time_seconds_sum"] == 0.75
    assert sample["request_decode_time_seconds_sum"] == 1.25
    assert sample["request_inference_time_seconds_sum"] == 2.0
    assert sample["request_time_per_output_token_seconds_count"] == 2
    assert sample["request_params_n_sum"] == 2 and sample["request_params_n_count"] == 1
    assert sample["request_max_num_generation_tokens_sum"] == 10
    # Token counts go in 1-2-5 buckets up to the context length.
    assert "request_prompt_tokens_bucket100.0" in sample
    assert "request_prompt_tokens_bucket200.0" not in sample


def test_token_count_buckets_are_1_2_5_up_to_the_context():
    assert token_count_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert token_count_buckets(4096)[-3:] == [500, 1000, 2000]
    assert token_count_buckets(1) == [1]


def test_the_output_processor_counts_each_step_and_each_finished_request(llama_dir):
    """Per engine message: the prompts whose first token came, the generated tokens,
    TTFT and gaps per sequence; per finished sequence its phases; per finished
    request its n and its longest sequence."""
    from transformers import AutoTokenizer

    from loraserve.engine.output_processor import OutputProcessor
    from loraserve.engine.protocol import EngineCoreOutput, FinishReason
    from loraserve.sampling_params import SamplingParams

    processor = OutputProcessor(AutoTokenizer.from_pretrained(llama_dir))
    processor.add_request("r", None, [5, 6, 7], SamplingParams(n=2, max_tokens=3))
    times = RequestTimes(queued=1.0, scheduled=2.0)
    first = processor.process_outputs([EngineCoreOutput("r-0", [8], times=times),
                                       EngineCoreOutput("r-1", [9], times=times)], 3.0)
    assert (first.stats.num_prompt_tokens, first.stats.num_generation_tokens) == (6, 2)
    assert len(first.stats.time_to_first_token_s) == 2 and not first.stats.finished_requests
    second = processor.process_outputs([
        EngineCoreOutput("r-0", [10], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput("r-1", [11]),
    ], 3.5)
    assert (second.stats.num_prompt_tokens, second.stats.num_generation_tokens) == (0, 2)
    assert len(second.stats.inter_token_latency_s) == 2
    (done,) = second.stats.finished_requests
    assert done.finish_reason == "length" and done.num_generation_tokens == 2
    assert (done.queue_s, done.prefill_s, done.decode_s) == (1.0, 1.0, 0.5)
    assert not second.stats.finished_parents
    third = processor.process_outputs(
        [EngineCoreOutput("r-1", [], finish_reason=FinishReason.STOP, stop_reason=11)], 4.0)
    (done,) = third.stats.finished_requests
    assert done.finish_reason == "stop" and done.max_tokens == 3
    assert third.stats.finished_parents == [(2, 2)]
