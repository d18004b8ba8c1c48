"""The serving benchmark (`python -m benchmarks.serve`) against a tiny `loraserve
serve` with four adapters from `benchmarks.make_bench_setup` (registered through
the --config file it writes) in two slots: every request succeeds with exactly
output-len tokens, the statistics are in order, the adapters are drawn as the
distribution says, open-loop runs stop at their bound, and requests with a JSON
schema answer with JSON the schema accepts, their TPOT apart from the others'.
No assertion on speed."""

from __future__ import annotations

import json
import math
import random
import shlex
import statistics

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from serve_utils import ServerProcess

from benchmarks import make_bench_setup, workload
from benchmarks.serve import cli, load, report, runs, server_metrics, structured

NUM_REQUESTS = 12
INPUT_LEN = 16
OUTPUT_LEN = 8
MAX_LORAS = 2
ADAPTERS = [f"lora{i}" for i in range(4)]
# Room for the schema's longest answer in the tiny model's small vocabulary (its
# answers take 70 to 90 tokens).
STRUCTURED_OUTPUT_LEN = 192


@pytest.fixture(scope="module")
def bench_setup(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_setup")
    return make_bench_setup.main([
        "--out", str(out), "--base-model", llama_dir, "--num-adapters", str(len(ADAPTERS)),
        "--distinct", "2", "--rank", "8", "--target-modules", "attention",
        "--dtype", "float32"])


@pytest.fixture(scope="module")
def server(llama_dir, bench_setup):
    with ServerProcess([
        llama_dir, "--served-model-name", "base", "--enable-lora",
        "--max-loras", str(MAX_LORAS), "--max-num-seqs", "16",
        "--config", bench_setup["config"],
        # A random model would write whitespace between JSON tokens up to max_tokens.
        "--structured-outputs-config", '{"disable_any_whitespace": true}',
    ]) as srv:
        yield srv


def check_adapters_per_step(server, figure, text: str) -> None:
    """The server's distinct adapters per step over an all-adapter run: within
    [1, --max-loras] where the server exports the histogram, else n/a."""
    exported = server_metrics.histogram_totals(server.get("/metrics").text,
                                               server_metrics.STEP_ADAPTERS)
    if exported is None:
        assert figure is None
        assert "n/a" in text
    else:
        assert figure is not None and figure["steps"] >= OUTPUT_LEN
        assert 1.0 <= figure["mean"] <= MAX_LORAS


@pytest.mark.parametrize("rate_args", [["--request-rate", "inf"],
                                       ["--request-rate", "40", "--arrival", "fixed"]],
                         ids=["inf", "fixed"])
def test_serve_benchmark(server, tmp_path, rate_args):
    out = tmp_path / "serve.json"
    argv = [server.url, "--num-requests", str(NUM_REQUESTS), *rate_args,
            "--num-adapters", str(len(ADAPTERS)), "--adapter-pattern", "lora{}",
            "--adapter-dist", "zipf", "--zipf-alpha", "1.1",
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
            "--request-timeout", "60", "--seed", "3", "--json", str(out)]
    cli.main(argv)
    results = json.loads(out.read_text())

    assert results["command"] == shlex.join(["python", "-m", "benchmarks.serve", *argv])
    assert results["machine"]
    assert results["base_model"] == "base"
    assert results["adapters"] == ADAPTERS
    weights = [1 / k ** 1.1 for k in range(1, len(ADAPTERS) + 1)]
    assert list(results["adapter_probabilities"].values()) == pytest.approx(
        [w / sum(weights) for w in weights])
    assert results["failures"] == 0, results["errors"]
    assert results["not_sent"] == 0
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
        assert all(stats[s] is not None and stats[s] > 0
                   for s in ["mean_ms", "p50_ms", "p99_ms", "max_ms"])
        assert stats["p50_ms"] <= stats["p99_ms"] <= stats["max_ms"]
    assert results["ttft"]["p99_ms"] <= results["e2e"]["p99_ms"]
    # The longest wait is the slowest request's TTFT.
    assert results["ttft"]["max_ms"] == pytest.approx(
        max(r["ttft_s"] for r in results["requests"]) * 1000)
    check_adapters_per_step(server, results["adapters_per_step"], report.format_table(results))

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
    expected = workload.pick_models(NUM_REQUESTS, "base", ADAPTERS, "zipf", 1.1, 0.0,
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
    with pytest.raises(SystemExit, match="lora4"):
        cli.main([server.url, "--num-requests", "1", "--num-adapters", "5",
                  "--adapter-pattern", "lora{}"])


def test_open_loop_run_stops_at_max_outstanding(server):
    """Arrivals far faster than the server: once two requests are outstanding the
    run sends nothing more, finishes the two, and counts the rest as failed."""
    argv = [server.url, "--num-requests", "8", "--request-rate", "1000",
            "--max-outstanding", "2", "--input-len", "8", "--output-len", "8",
            "--request-timeout", "60", "--seed", "1"]
    offsets = workload.arrival_offsets(8, 1000.0, "poisson", random.Random("1-arrivals"))
    assert offsets[2] < 0.05  # the third is due long before a request can finish
    results = cli.main(argv)
    sent = [r for r in results["requests"] if r["sent"]]
    assert [r["index"] for r in sent] == [0, 1]
    assert all(r["success"] for r in sent)
    assert results["completed"] == 2
    assert results["not_sent"] == 6 and results["failures"] == 6
    assert all("--max-outstanding" in e for e in results["errors"])
    # Closed loop (an infinite rate) sends everything whatever the bound.
    results = cli.main([*argv[:4], "inf", *argv[5:]])
    assert results["completed"] == 8 and results["failures"] == 0


def chi_square(counts: list[int], probabilities: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probabilities, strict=True))


# The chi-square distribution's 99.9% point at 9 degrees of freedom.
CHI2_999_DF9 = 27.877


def test_zipf_sampling_matches_its_distribution():
    """20,000 seeded draws over 10 adapters at alpha 1: the counts pass a
    chi-square test against p_k = (1/k) / H_10 (and fail one against uniform and
    against alpha 2), and the most popular ranks come out in order."""
    n, adapters = 20000, [f"a{k}" for k in range(10)]
    harmonic = sum(1 / k for k in range(1, 11))
    zipf = [1 / k / harmonic for k in range(1, 11)]
    assert workload.adapter_weights(10, "zipf", 1.0) == pytest.approx(zipf)
    picks = workload.pick_models(n, "base", adapters, "zipf", 1.0, 0.0, random.Random(7))
    counts = [picks.count(a) for a in adapters]
    assert sum(counts) == n
    assert chi_square(counts, zipf) < CHI2_999_DF9
    assert chi_square(counts, [0.1] * 10) > 100 * CHI2_999_DF9
    assert chi_square(counts, workload.adapter_weights(10, "zipf", 2.0)) > 100 * CHI2_999_DF9
    assert counts[:5] == sorted(counts[:5], reverse=True)
    uniform = workload.pick_models(n, "base", adapters, "uniform", 1.0, 0.0, random.Random(7))
    assert chi_square([uniform.count(a) for a in adapters], [0.1] * 10) < CHI2_999_DF9
    # The same seed draws the same adapters.
    assert workload.pick_models(50, "base", adapters, "zipf", 1.0, 0.0,
                            random.Random(7)) == picks[:50]


def test_base_fraction_and_no_adapters():
    n, adapters = 20000, ["a", "b", "c"]
    picks = workload.pick_models(n, "base", adapters, "uniform", 1.0, 0.25, random.Random(0))
    assert picks.count("base") / n == pytest.approx(0.25, abs=0.015)
    for name in adapters:
        assert picks.count(name) / n == pytest.approx(0.25, abs=0.015)
    assert workload.pick_models(5, "base", [], "zipf", 1.0, 0.0, random.Random(0)) == ["base"] * 5


def test_poisson_interarrivals():
    """Exponential gaps of mean 1/rate (their spread equals their mean, which
    fixed gaps lack), the first request at 0, and the same times for a seed."""
    poisson = workload.arrival_offsets(4000, 20.0, "poisson", random.Random(0))
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1 / 20, rel=0.07)
    assert workload.arrival_offsets(4000, 20.0, "poisson", random.Random(0)) == poisson
    assert workload.arrival_offsets(3, 4.0, "fixed", random.Random(0)) == [0.0, 0.25, 0.5]
    assert workload.arrival_offsets(3, math.inf, "poisson", random.Random(0)) == [0.0, 0.0, 0.0]


def test_percentiles_on_known_data():
    assert report.percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert report.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert report.percentile([], 50) is None
    # 1..100 ms, shuffled: numpy's linear interpolation gives p50 50.5, p99 99.01.
    values = [k / 1000 for k in range(1, 101)]
    random.Random(0).shuffle(values)
    stats = report.summarize(values)
    assert stats == pytest.approx({"mean_ms": 50.5, "p50_ms": 50.5, "p99_ms": 99.01,
                                   "max_ms": 100.0})
    assert report.summarize([]) == {"mean_ms": None, "p50_ms": None, "p99_ms": None,
                                    "max_ms": None}


def test_adapters_per_step_from_two_scrapes():
    """The mean over a run is the histogram's growth in sum over its growth in
    count, summed over label sets; n/a without the histogram or without steps."""
    registry = CollectorRegistry()
    steps = Histogram(server_metrics.STEP_ADAPTERS, "Distinct adapters per step.",
                      ["model_name"], registry=registry, buckets=[1, 2, 4, 8])
    for value in (1, 2, 3):
        steps.labels("base").observe(value)
    text = generate_latest(registry).decode()
    before = server_metrics.histogram_totals(text, server_metrics.STEP_ADAPTERS)
    assert before == (6.0, 3.0)
    steps.labels("base").observe(4)
    steps.labels("other").observe(6)
    after = server_metrics.histogram_totals(generate_latest(registry).decode(),
                                            server_metrics.STEP_ADAPTERS)
    assert server_metrics.mean_over_run(before, after) == {"steps": 2.0, "mean": 5.0}
    assert server_metrics.mean_over_run(before, before) is None
    assert server_metrics.mean_over_run(None, after) is None
    vllm_only = text.replace("loraserve:", "vllm:")
    assert server_metrics.histogram_totals(vllm_only, server_metrics.STEP_ADAPTERS) is None


def test_phases_with_length_ranges_over_two_clients(server, tmp_path):
    """A warm-up phase, then alternating base and LoRA phases over two client
    processes: each phase sends every request to its kind of model, with lengths
    drawn in the ranges (the same draws in every phase), the summary ratios come
    from the medians of the timed phases' figures, and --results-md gets a row per
    kind with the commands."""
    out, rows = tmp_path / "phases.json", tmp_path / "results.md"
    argv = [server.url, "--num-requests", "8", "--phases", "base,lora,base,lora",
            "--warmup-phases", "lora", "--num-clients", "2", "--max-concurrency", "4",
            "--input-len", "4:24", "--output-len", "2:9",
            "--request-timeout", "60", "--seed", "5", "--json", str(out),
            "--results-md", str(rows), "--label", "c4 two clients",
            "--server-command", "loraserve serve tiny --max-loras 2", "--notes", "CPU"]
    results = cli.main(argv)
    assert json.loads(out.read_text())["phases"] == results["phases"]
    assert results["failures"] == 0
    [warmup] = results["warmup"]
    assert warmup["phase"] == "lora" and warmup["completed"] == 8
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
    lora_ttft_p99 = [p["ttft"]["p99_ms"] for p in phases if p["phase"] == "lora"]
    assert results["lora_ttft_p99_ms"] == pytest.approx(statistics.median(lora_ttft_p99))
    lora_max = [p["ttft"]["max_ms"] for p in phases if p["phase"] == "lora"]
    assert results["lora_ttft_max_ms"] == pytest.approx(statistics.median(lora_max))
    table = report.format_table(results)
    assert "Served LoRA/base: " in table and "(lora warm-up)" in table
    for phase in phases:
        if phase["phase"] == "lora":
            check_adapters_per_step(server, phase["adapters_per_step"], table)

    lines = rows.read_text().splitlines()
    assert lines[:2] == report.RESULTS_HEADER
    assert [line.split(" | ")[:2] for line in lines[2:]] == [["| c4 two clients", "base ×2"],
                                                             ["| c4 two clients", "lora ×2"]]
    lora_row = lines[3].split(" | ")
    assert lora_row[2] == f"{results['lora_output_tok_per_s']:.1f}"
    assert lora_row[3] == f"{results['lora_over_base_output_tok_per_s']:.3f}"
    assert lora_row[6] == f"{results['lora_ttft_max_ms']:.2f}"
    assert lora_row[7] == "0"  # failed
    assert "server: `loraserve serve tiny --max-loras 2`" in lines[3]
    # The command that measures it: without the flags that only say where figures go.
    measured = argv[:argv.index("--json")]  # the reporting flags come last
    assert f"client: `{shlex.join(['python', '-m', 'benchmarks.serve', *measured])}` |" in lines[3]
    # A second run appends rows under the same header.
    cli.main([*argv[:4], "lora", *argv[7:]])  # no warm-up, one LoRA phase
    lines = rows.read_text().splitlines()
    assert len(lines) == 5 and lines.count(report.RESULTS_HEADER[0]) == 1


def test_poisson_phases_share_their_send_times(server):
    """Open-loop Poisson phases: each phase's requests are due at the same seeded
    times (exponential gaps), go to its kind of model, and all succeed."""
    results = cli.main([server.url, "--num-requests", "10", "--request-rate", "100",
                        "--phases", "base,lora", "--num-adapters", "4",
                        "--adapter-dist", "zipf", "--input-len", "8", "--output-len", "4",
                        "--request-timeout", "60", "--seed", "2"])
    assert results["failures"] == 0
    expected = workload.arrival_offsets(10, 100.0, "poisson", random.Random("2-arrivals"))
    for phase in results["phases"]:
        assert [r["scheduled_s"] for r in phase["requests"]] == pytest.approx(expected)
        assert all(r["start_s"] >= r["scheduled_s"] - 1e-3 for r in phase["requests"])
        models = {r["model"] for r in phase["requests"]}
        assert models == {"base"} if phase["phase"] == "base" else models <= set(ADAPTERS)


def test_row_command_leaves_out_reporting_flags():
    command = ("python -m benchmarks.serve http://h:1 --json a.json --label 'c 64' "
               "--results-md=r.md --notes 'start 9 s' --server-command 'loraserve serve m' "
               "--num-requests 4 --adapter-pattern 'lora{}'")
    assert report.measurement_command(command) == (
        "python -m benchmarks.serve http://h:1 --num-requests 4 --adapter-pattern 'lora{}'")


# ---- requests with a JSON schema ---------------------------------------------------


def test_constrained_requests_are_picked_evenly_from_the_seed():
    """1 in 32 of 256 requests: 8, one in each stretch of 32, the same for a seed;
    a fraction rounds to the nearest count, at least one; and every schema phase
    constrains the same requests, with the lengths, times and models of a plain
    phase, which constrains none."""
    def count(num: int, fraction: float, seed: int = 0) -> int:
        return sum(structured.pick_constrained(num, fraction, random.Random(seed)))

    picks = structured.pick_constrained(256, 1 / 32, random.Random(4))
    assert [sum(picks[k * 32:(k + 1) * 32]) for k in range(8)] == [1] * 8
    assert picks == structured.pick_constrained(256, 1 / 32, random.Random(4))
    assert picks != structured.pick_constrained(256, 1 / 32, random.Random(5))
    assert count(12, 0.5) == 6 and count(10, 0.25) == 3 and count(16, 1 / 32) == 1
    assert count(5, 0.0) == 0 and count(5, 1.0) == 5

    args = cli.parse_args(["--num-requests", "64", "--structured-fraction", "0.125",
                           "--phases", "plain,schema,schema", "--seed", "9",
                           "--input-len", "4:32", "--vocab-size", "1000"])
    target = load.Target("http://127.0.0.1:1/v1/completions", {}, "base", [], 1000)
    plain = runs.plan_run(args, target, "plain", "0")[0]
    first, prompts = runs.plan_run(args, target, "schema", "1")
    second = runs.plan_run(args, target, "schema", "2")[0]
    unphased = runs.plan_run(args, target, None, "0")[0]
    assert not any(r.constrained for r in plain)
    chosen = [r.index for r in first if r.constrained]
    assert len(chosen) == 8
    assert all(8 * k <= i < 8 * (k + 1) for k, i in enumerate(chosen))
    assert chosen == [r.index for r in second if r.constrained]
    assert chosen == [r.index for r in unphased if r.constrained]
    assert [(r.prompt_len, r.max_tokens, r.scheduled_s, r.model) for r in first] == [
        (r.prompt_len, r.max_tokens, r.scheduled_s, r.model) for r in plain]

    body = load.payload(first[chosen[0]], prompts[chosen[0]])
    assert body["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "benchmark_record", "schema": structured.SCHEMA}}
    assert body["ignore_eos"] and body["max_tokens"] == 128
    assert "response_format" not in load.payload(plain[0], prompts[0])
    with pytest.raises(SystemExit):
        cli.parse_args(["--phases", "plain,schema"])  # a schema phase without a fraction
    with pytest.raises(SystemExit):
        cli.parse_args(["--structured-fraction", "1.5"])


def test_answers_are_checked_against_the_schema():
    """The schema compiles as the server compiles it (no keyword it would refuse);
    an answer passes only when it is JSON that the schema accepts."""
    from loraserve.config import StructuredOutputsConfig
    from loraserve.structured_output.grammar import build_grammar
    from loraserve.structured_output.params import StructuredOutputsParams

    build_grammar(StructuredOutputsParams(json=structured.SCHEMA), StructuredOutputsConfig())
    assert structured.CHECKED_WITH == "jsonschema"
    good = {"name": "Ada", "age": 36, "status": "active", "verified": True,
            "tags": ["x", "abcdefgh"]}
    assert structured.valid_answer(json.dumps(good))
    for change in [{"status": "gone"}, {"age": 121}, {"age": 3.5}, {"name": ""},
                   {"tags": ["a", "b", "c", "d"]}, {"tags": ["abcdefghi"]}, {"extra": 1},
                   {"verified": "yes"}]:
        assert not structured.valid_answer(json.dumps({**good, **change})), change
    assert not structured.valid_answer(json.dumps({k: v for k, v in good.items()
                                                   if k != "tags"}))
    assert not structured.valid_answer('{"name": "Ada", "age"')  # cut at max_tokens
    assert not structured.valid_answer("")


def _record(index: int, tpot_ms: float, tokens: int, constrained: bool = False,
            valid: bool | None = None, success: bool = True) -> load.RequestRecord:
    record = load.RequestRecord(index, "base", 4, 10, 0.0, constrained=constrained)
    record.sent, record.success = True, success
    if success:
        record.output_tokens, record.ttft_s = tokens, 0.01
        record.tpot_s = tpot_ms / 1000
        record.e2e_s = record.ttft_s + record.tpot_s * (tokens - 1)
        record.finish_reason = "stop" if constrained else "length"
        record.valid_json = valid
    return record


def test_tpot_of_constrained_and_unconstrained_requests_apart():
    """Known TPOTs: each kind's mean, p50 and p99 over its own requests, the
    constrained answers counted, and only unconstrained requests held to
    max_tokens; the console table and the results row show both kinds."""
    records = [_record(i, 10.0 + i, 10) for i in range(4)] + [
        _record(4, 14.0, 9),  # an unconstrained request that stopped short
        _record(5, 20.0, 6, constrained=True, valid=True),
        _record(6, 30.0, 4, constrained=True, valid=False),
        _record(7, 0.0, 0, constrained=True, success=False)]
    results = report.build_results(records, 2.0, None)
    assert results["unconstrained_tpot"] == pytest.approx(
        {"mean_ms": 12.0, "p50_ms": 12.0, "p99_ms": 13.96, "max_ms": 14.0})
    assert results["constrained"] == {
        "requests": 3, "completed": 2, "valid_json": 1, "checked_with": "jsonschema",
        "ended_by_stop": 2, "output_tokens_mean": 5.0,
        "tpot": pytest.approx({"mean_ms": 25.0, "p50_ms": 25.0, "p99_ms": 29.9,
                               "max_ms": 30.0})}
    assert results["tpot"]["p50_ms"] == pytest.approx(13.0)  # all seven together
    assert results["output_len_mismatches"] == 1

    results.update(machine="CPU", base_model="base", adapters=[],
                   command="python -m benchmarks.serve --structured-fraction 0.375")
    table = report.format_table(results)
    for line in ["Constrained requests  2/3 ok, 1 valid JSON (jsonschema), 2 ended by stop, "
                 "mean output 5.0 tokens", "Unconstrained TPOT p99 (ms)  13.96",
                 "Constrained TPOT p50 (ms)    25.00"]:
        name, value = line.split("  ", 1)
        assert any(row.startswith(name) and row.endswith(value.strip())
                   for row in table.splitlines()), line
    [row] = report.results_rows(results, "mixed run")
    cells = row.split(" | ")
    assert cells[9:13] == ["12.00 / 13.96", "25.00 / 29.90", "1/3", "-"]
    assert len(cells) == len(report.RESULTS_HEADER[0].split(" | "))


def _phase(kind: str, plain_ms: tuple[float, float] | None = None,
           unconstrained_ms: tuple[float, float] | None = None,
           constrained_ms: tuple[float | None, float | None] = (None, None)) -> dict:
    def stats(pair):
        return {"p50_ms": pair[0], "p99_ms": pair[1]}
    return {"phase": kind, "tpot": stats(plain_ms or unconstrained_ms),
            "unconstrained_tpot": stats(unconstrained_ms or plain_ms),
            "constrained": {"tpot": stats(constrained_ms)}}


def test_schema_phases_against_their_plain_partners():
    """The k-th plain phase pairs with the k-th schema phase; each ratio is the
    schema phase's figure over its partner's TPOT, and the summary the median
    over the pairs (a pair without constrained TPOT left out of it)."""
    phases = [_phase("plain", (10.0, 20.0)),
              _phase("schema", unconstrained_ms=(10.5, 21.0), constrained_ms=(11.0, 22.0)),
              _phase("plain", (12.0, 24.0)),
              _phase("schema", unconstrained_ms=(12.0, 24.0), constrained_ms=(12.6, 30.0)),
              _phase("plain", (8.0, 16.0)),
              _phase("schema", unconstrained_ms=(8.0, 16.0)),  # no constrained request ended
              _phase("schema", unconstrained_ms=(9.0, 18.0), constrained_ms=(9.0, 18.0))]
    out = report.compare_plain_schema(phases)
    assert [(p["plain"], p["schema"]) for p in out["plain_schema_pairs"]] == [
        (0, 1), (2, 3), (4, 5)]
    first = out["plain_schema_pairs"][0]
    assert first["constrained_over_plain_tpot_p50"] == pytest.approx(1.1)
    assert first["unconstrained_over_plain_tpot_p99"] == pytest.approx(1.05)
    assert out["plain_schema_pairs"][2]["constrained_over_plain_tpot_p50"] is None
    assert out["constrained_over_plain_tpot_p50"] == pytest.approx((1.1 + 1.05) / 2)
    assert out["constrained_over_plain_tpot_p99"] == pytest.approx((1.1 + 1.25) / 2)
    assert out["unconstrained_over_plain_tpot_p50"] == pytest.approx(1.0)  # of 1.05, 1, 1
    assert report.compare_plain_schema(phases[:1])["constrained_over_plain_tpot_p50"] is None


def check_constrained(record: dict) -> None:
    """A constrained request's answer: JSON that the schema accepts, ended by
    itself before max_tokens, with TPOT over its own tokens."""
    import jsonschema

    assert record["success"] and record["valid_json"] is True
    jsonschema.validate(json.loads(record["output_text"]), structured.SCHEMA)
    assert record["finish_reason"] == "stop"
    assert 1 < record["output_tokens"] < record["max_tokens"]
    assert record["tpot_s"] == pytest.approx(
        (record["e2e_s"] - record["ttft_s"]) / (record["output_tokens"] - 1))


def test_structured_fraction_end_to_end(server, tmp_path):
    """Half the requests with the schema, to the base model and two adapters:
    every constrained answer is JSON that the schema accepts; plain and schema
    phases give the TPOT of each kind apart, the schema/plain ratios from their
    medians, and a results row per kind."""
    rows = tmp_path / "results.md"
    common = [server.url, "--num-requests", "6", "--structured-fraction", "0.5",
              "--max-concurrency", "6", "--input-len", "8",
              "--output-len", str(STRUCTURED_OUTPUT_LEN), "--num-adapters", "2",
              "--base-fraction", "0.5", "--request-timeout", "60", "--seed", "1"]
    unphased = cli.main(common)
    assert unphased["failures"] == 0 and unphased["output_len_mismatches"] == 0
    assert unphased["constrained"]["valid_json"] == unphased["constrained"]["requests"] == 3

    results = cli.main([*common, "--phases", "plain,schema,plain,schema",
                        "--results-md", str(rows), "--label", "half"])
    assert results["failures"] == 0
    phases = results["phases"]
    chosen = None
    for phase in phases:
        constrained = [r for r in phase["requests"] if r["constrained"]]
        for r in phase["requests"]:
            assert r["served_model"] == r["model"]
            if not r["constrained"]:
                assert r["output_tokens"] == r["max_tokens"] and r["valid_json"] is None
        if phase["phase"] == "plain":
            assert not constrained and phase["constrained"]["requests"] == 0
            assert phase["unconstrained_tpot"] == phase["tpot"]
            continue
        assert len(constrained) == 3
        assert chosen in (None, [r["index"] for r in constrained])
        chosen = [r["index"] for r in constrained]
        for r in constrained:
            check_constrained(r)
        figures = phase["constrained"]
        assert figures["valid_json"] == figures["ended_by_stop"] == 3
        assert figures["tpot"]["p50_ms"] == pytest.approx(
            statistics.median(r["tpot_s"] * 1000 for r in constrained))
    assert {r["model"] for r in phases[1]["requests"] if r["constrained"]} > {"base"}
    pairs = [(phases[0], phases[1]), (phases[2], phases[3])]
    assert results["constrained_over_plain_tpot_p50"] == pytest.approx(statistics.median(
        s["constrained"]["tpot"]["p50_ms"] / p["tpot"]["p50_ms"] for p, s in pairs))
    assert results["unconstrained_over_plain_tpot_p99"] == pytest.approx(statistics.median(
        s["unconstrained_tpot"]["p99_ms"] / p["tpot"]["p99_ms"] for p, s in pairs))

    table = report.format_table(results)
    assert "Constrained/plain TPOT: p50 " in table
    assert "Unconstrained-in-mixed/plain TPOT: p50 " in table
    assert "Valid JSON: 6/6 constrained answers" in table
    assert "Served LoRA/base" not in table
    lines = rows.read_text().splitlines()
    assert [line.split(" | ")[1] for line in lines[2:]] == ["plain ×2", "schema ×2"]
    schema_row = lines[3].split(" | ")
    assert schema_row[11] == "6/6"
    assert schema_row[12] == (f"{results['constrained_over_plain_tpot_p50']:.3f} / "
                              f"{results['unconstrained_over_plain_tpot_p50']:.3f}")
