"""The serving benchmark (`python -m benchmarks.serve`) against a tiny `loraserve
serve` with two adapters: every request succeeds with exactly output-len tokens,
the statistics are in order, and the adapters are drawn as the distribution says.
No assertion on speed."""

from __future__ import annotations

import json
import math
import random
import shlex

import pytest
from serve_utils import ServerProcess

from benchmarks.serve import cli, load, report

NUM_REQUESTS = 12
INPUT_LEN = 16
OUTPUT_LEN = 8
ADAPTERS = ["sql", "poet"]


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters):
    with ServerProcess([
        llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
        "--max-num-seqs", "16",
        "--lora-modules", f"sql={llama_adapters['r8']}", f"poet={llama_adapters['r16_qv']}",
    ]) as srv:
        yield srv


@pytest.mark.parametrize("rate_args", [["--request-rate", "inf"],
                                       ["--request-rate", "40", "--arrival", "fixed"]],
                         ids=["inf", "fixed"])
def test_serve_benchmark(server, tmp_path, rate_args):
    out = tmp_path / "serve.json"
    argv = [server.url, "--num-requests", str(NUM_REQUESTS), *rate_args,
            "--num-adapters", "2", "--adapter-dist", "zipf", "--zipf-s", "1.1",
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--request-timeout", "60", "--seed", "3", "--json", str(out)]
    cli.main(argv)
    results = json.loads(out.read_text())

    assert results["command"] == shlex.join(["python", "-m", "benchmarks.serve", *argv])
    assert results["machine"]
    assert results["base_model"] == "base"
    assert results["adapters"] == ADAPTERS
    assert results["failures"] == 0, results["errors"]
    assert results["completed"] == NUM_REQUESTS
    assert results["output_tokens"] == NUM_REQUESTS * OUTPUT_LEN
    assert results["input_tokens"] == NUM_REQUESTS * INPUT_LEN
    assert results["output_len_mismatches"] == 0
    assert NUM_REQUESTS <= results["output_chunks"] <= NUM_REQUESTS * OUTPUT_LEN
    for key in ["request_throughput", "output_tok_per_s", "total_tok_per_s"]:
        assert results[key] > 0
    assert results["total_tok_per_s"] > results["output_tok_per_s"]
    for key in ["ttft", "tpot", "itl", "e2e"]:
        stats = results[key]
        assert all(stats[s] is not None and stats[s] > 0 for s in ["mean_ms", "p50_ms", "p99_ms"])
        assert stats["p50_ms"] <= stats["p99_ms"]
    assert results["ttft"]["p99_ms"] <= results["e2e"]["p99_ms"]

    records = results["requests"]
    assert len(records) == NUM_REQUESTS
    for r in records:
        assert r["success"] and r["output_tokens"] == OUTPUT_LEN
        assert r["served_model"] == r["model"]  # the server answered as the adapter asked for
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / (OUTPUT_LEN - 1))
    # Only adapters (no base fraction), counted as the script reports them, and
    # the same draw as the script's own selection for this seed.
    counts = {name: sum(r["model"] == name for r in records) for name in ADAPTERS}
    assert sum(counts.values()) == NUM_REQUESTS
    assert results["model_counts"] == {k: v for k, v in counts.items() if v}
    expected = load.pick_models(NUM_REQUESTS, "base", ADAPTERS, "zipf", 1.1, 0.0,
                                 random.Random("3-models"))
    assert [r["model"] for r in records] == expected
    # Send times follow the schedule: all at 0 for inf, 1/40 s apart for fixed.
    scheduled = [r["scheduled_s"] for r in records]
    if rate_args[1] == "inf":
        assert scheduled == [0.0] * NUM_REQUESTS
    else:
        assert scheduled == pytest.approx([i / 40 for i in range(NUM_REQUESTS)])
        assert all(r["start_s"] >= r["scheduled_s"] - 1e-3 for r in records)


def test_failures_are_counted_and_bounded(server, tmp_path):
    """A request past --request-timeout fails without stalling the run; names the
    server does not serve are refused before any request goes out."""
    results = cli.main([server.url, "--num-requests", "3", "--input-len", "8",
                          "--output-len", "8", "--request-timeout", "0.0001"])
    assert results["failures"] == 3 and results["completed"] == 0
    assert all("timed out" in e for e in results["errors"])
    assert results["ttft"]["p50_ms"] is None
    with pytest.raises(SystemExit, match="nope"):
        cli.main([server.url, "--num-requests", "1", "--adapter-names", "nope"])


def test_adapter_distribution():
    """Many draws of the model picker match Zipf, uniform and the base fraction."""
    n, adapters = 20000, ["a", "b", "c"]
    zipf = [1 / k ** 1.1 for k in (1, 2, 3)]
    for dist, weights, base_fraction in [("zipf", zipf, 0.0), ("uniform", [1, 1, 1], 0.25)]:
        picks = load.pick_models(n, "base", adapters, dist, 1.1, base_fraction,
                                  random.Random(0))
        assert picks.count("base") / n == pytest.approx(base_fraction, abs=0.015)
        for name, w in zip(adapters, weights, strict=True):
            share = w / sum(weights) * (1 - base_fraction)
            assert picks.count(name) / n == pytest.approx(share, abs=0.015)
    assert load.pick_models(5, "base", [], "zipf", 1.1, 0.0, random.Random(0)) == ["base"] * 5


def test_arrivals_and_percentiles():
    rng = random.Random(0)
    poisson = load.arrival_offsets(4000, 20.0, "poisson", rng)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert load.arrival_offsets(3, 4.0, "fixed", rng) == [0.0, 0.25, 0.5]
    assert load.arrival_offsets(3, math.inf, "poisson", rng) == [0.0, 0.0, 0.0]
    assert report.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert report.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert report.percentile([], 50) is None


def test_phases_with_length_ranges_over_two_clients(server, tmp_path):
    """Alternating base and LoRA phases over two client processes: each phase sends
    every request to its kind of model, with lengths drawn in the ranges (the same
    draws in every phase), and the summary ratios come from the phases' figures."""
    out = tmp_path / "phases.json"
    results = cli.main([server.url, "--num-requests", "8", "--phases", "base,lora,base,lora",
                          "--num-clients", "2", "--max-concurrency", "4",
                          "--input-len", "4:24", "--output-len", "2:9",
                          "--request-timeout", "60", "--seed", "5", "--json", str(out)])
    assert json.loads(out.read_text())["phases"] == results["phases"]
    assert results["failures"] == 0
    phases = results["phases"]
    assert [p["phase"] for p in phases] == ["base", "lora", "base", "lora"]
    lengths = None
    for phase in phases:
        records = phase["requests"]
        assert [r["index"] for r in records] == list(range(8))
        assert all(r["success"] and r["output_tokens"] == r["max_tokens"] for r in records)
        models = {r["served_model"] for r in records}
        assert models == {"base"} if phase["phase"] == "base" else models <= set(ADAPTERS)
        these = [(r["prompt_len"], r["max_tokens"]) for r in records]
        assert all(4 <= i <= 24 and 2 <= o <= 9 for i, o in these)
        assert lengths is None or these == lengths
        lengths = these
    assert len(set(lengths)) > 1  # the ranges were drawn from, not one fixed length
    base = sorted(p["output_tok_per_s"] for p in phases if p["phase"] == "base")
    lora = sorted(p["output_tok_per_s"] for p in phases if p["phase"] == "lora")
    assert results["lora_over_base_output_tok_per_s"] == pytest.approx(
        (lora[0] + lora[1]) / (base[0] + base[1]))
    assert "Served LoRA/base: " in report.format_table(results)
