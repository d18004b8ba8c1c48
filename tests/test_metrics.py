"""Prometheus metrics: names with the `loraserve:` prefix, lora_requests_info as
DESIGN.md defines it, adapter residency, and output that prometheus_client parses."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from loraserve.engine.protocol import SchedulerStats
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
    resident = {(s.labels["adapter"], s.labels["level"])
                for s in found["loraserve:lora_adapter_resident"].samples}
    assert resident == {("a", "gpu"), ("b", "gpu"), ("a", "cpu"), ("b", "cpu"), ("c", "cpu")}


def test_residency_follows_evictions_and_preemptions_count_once():
    metrics = ServerMetrics("m", max_loras=1)
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["a"], cpu_lora_adapters=["a"],
                                        num_preemptions=2))
    metrics.record_stats(SchedulerStats(gpu_lora_adapters=["b"], cpu_lora_adapters=["b"],
                                        num_preemptions=2))
    found = families(metrics)
    resident = {(s.labels["adapter"], s.labels["level"])
                for s in found["loraserve:lora_adapter_resident"].samples}
    assert resident == {("b", "gpu"), ("b", "cpu")}
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
