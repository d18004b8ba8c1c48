"""Figures read from the server's own Prometheus /metrics around a run: the mean
number of distinct adapters per engine step, from the histogram the engine
observes once per step (its _sum and _count grow over the run)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.serve.load import httpx

# loraserve's own name: vLLM has no such metric, so there is no vllm: spelling.
STEP_ADAPTERS = "loraserve:step_lora_adapters"


def histogram_totals(text: str, name: str) -> tuple[float, float] | None:
    """(sum, count) of histogram `name` over all its label sets in an exposition
    text, or None when the text has no such histogram."""
    total = count = 0.0
    found = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_sum":
                total += sample.value
                found = True
            elif sample.name == f"{name}_count":
                count += sample.value
                found = True
    return (total, count) if found else None


def scrape_step_adapters(base_url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    """The step-adapters histogram's (sum, count) now, or None when the server
    exports no such histogram or has no /metrics."""
    try:
        response = httpx.get(f"{base_url.rstrip('/')}/metrics", headers=headers, timeout=30.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return histogram_totals(response.text, STEP_ADAPTERS)


def mean_over_run(before: tuple[float, float] | None,
                  after: tuple[float, float] | None) -> dict[str, float] | None:
    """Steps and mean distinct adapters per step between two scrapes; None when
    either scrape lacked the histogram or no step ran in between."""
    if before is None or after is None:
        return None
    steps = after[1] - before[1]
    if steps <= 0:
        return None
    return {"steps": steps, "mean": (after[0] - before[0]) / steps}
