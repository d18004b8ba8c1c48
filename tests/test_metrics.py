"""Prometheus metrics: names with the `loraserve:` prefix, lora_requests_info as
DESIGN.md defines it, adapter residency (vLLM's lora_adapter_loaded and the
loaded-adapter counts), adapter load times, and output that prometheus_client
parses."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.protocol import SchedulerStats
from loraserve.lora.load_times import LORA_LOAD_TIME_BUCKETS_S, lora_load_time_bucket
from loraserve.metrics import ServerMetrics


def families(metrics: ServerMetrics) -> dict:
    text = metrics.render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_metric_has_the_prefix_and_parses():
    metrics = ServerMetrics("m", max_loras=2)
    metrics.record_prompt_tokens(7)
    metrics.record_tokens(1, 0.05, None)
    metrics.record_tokens(3, None, 0.01)
    metrics.record_finished(["stop", "length"], 0.5)
    found = families(metrics)
    assert found and all(name.startswith("loraserve:") for name in found)
    sample = {s.name: s.value for f in found.values() for s in f.samples}
    assert sample['loraserve:prompt_tokens_total'] == 7
    assert sample['loraserve:generation_tokens_total'] == 4
    assert sample['loraserve:time_to_first_token_seconds_count'] == 1
    assert sample['loraserve:inter_token_latency_seconds_count'] == 1
    assert sample['loraserve:e2e_request_latency_seconds_count'] == 1
    reasons = {s.labels["finished_reason"] for s in found["loraserve:request_success"].samples
               if s.name.endswith("_total")}
    assert reasons == {"stop", "length"}


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
    one.record_prompt_tokens(5)
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
    metrics.record_finished(["stop"], 0.1)
    exposed = {s.name for f in families(metrics).values() for s in f.samples}
    assert used and used <= exposed, used - exposed


def test_lora_metrics_only_with_lora():
    metrics = ServerMetrics("m", max_loras=None)
    metrics.record_stats(SchedulerStats(num_running=1))
    names = set(families(metrics))
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
