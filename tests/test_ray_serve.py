"""loraserve on Ray Serve, on a local Ray cluster: two engine replicas of the tiny
Llama behind one ingress, four PEFT adapters.

Each adapter's requests stay on the replica that read it (Ray Serve's model
multiplexing), the answers equal a single `loraserve serve`'s (whose own tests
compare it with transformers+PEFT), runtime load and unload reach every replica,
and a client that retries loses no request when a replica is killed."""

from __future__ import annotations

import json
import os
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_utils import ServerProcess, free_port, wait_until

pytest.importorskip("ray.serve")

from loraserve.cli_args import build_parser, build_server_settings, ray_options, validate_args  # noqa: E402

ADAPTERS = ("r8", "r16_qv", "r1", "r8_mlp")
REPLICA = "x-loraserve-replica"
PROMPT = "The quick brown fox"
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
# Both servers get the same engine flags.
ENGINE_FLAGS = ["--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                "--max-cpu-loras", "2", "--max-lora-rank", "16", "--max-num-seqs", "8"]


def lora_modules(llama_adapters) -> list[str]:
    return ["--lora-modules", *[f"{name}={llama_adapters[name]}" for name in ADAPTERS]]


@pytest.fixture(scope="module")
def single(llama_dir, llama_adapters):
    with ServerProcess([llama_dir, *ENGINE_FLAGS, *lora_modules(llama_adapters)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster(llama_dir, llama_adapters):
    """The application's URL; Ray goes down with the module."""
    import ray
    from ray import serve

    from loraserve.ray.app import APP_NAME, build_application

    saved = os.environ.get("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING")
    os.environ["LORASERVE_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Two replicas and the ingress on a 2-core machine: Ray counts 4 CPUs, the
    # replicas reserve half of one each.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = build_parser().parse_args([
            "serve-ray", llama_dir, *ENGINE_FLAGS, *lora_modules(llama_adapters),
            "--num-replicas", "2", "--replica-num-cpus", "0.5",
        ])
        validate_args(args)
        settings, tokenizer = build_server_settings(args)
        serve.run(build_application(settings, tokenizer, ray_options(args)), name=APP_NAME,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if saved is None:
            os.environ.pop("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", None)
        else:
            os.environ["LORASERVE_ALLOW_RUNTIME_LORA_UPDATING"] = saved


def complete(url: str, model: str, prompt: str = PROMPT, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, **GREEDY, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def chat_stream(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            **GREEDY}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])


def replica_states(calls: int = 100) -> dict[str, dict]:
    """describe() of each engine replica that answers, asked through Ray Serve's own
    handle (it picks a replica per call) until two have answered."""
    from ray import serve

    handle = serve.get_deployment_handle("EngineReplica", app_name="loraserve")
    found: dict[str, dict] = {}
    for _ in range(calls):
        info = handle.describe.remote().result(timeout_s=30)
        found[info["replica"]] = info
        if len(found) == 2:
            break
    return found


def every_replica() -> list[dict]:
    found = replica_states()
    assert len(found) == 2, f"only replicas {sorted(found)} answered"
    return list(found.values())


def test_each_adapter_stays_on_the_replica_that_loaded_it(cluster):
    # The first test to name the adapters: no replica holds any of them yet.
    home: dict[str, str] = {}
    for name in ADAPTERS:
        response = complete(cluster, name)
        assert response.status_code == 200, response.text
        home[name] = response.headers[REPLICA]
        assert response.headers["x-loraserve-adapter-read"] == "1"
        # The replica tells Ray Serve's controller what it holds, which tells the
        # ingress's router: let that round trip finish before the next adapter.
        time.sleep(1.0)
    # Ray Serve sends a new adapter to the replica holding the fewest; each replica
    # holds at most --max-cpu-loras (2) of them.
    assert sorted(Counter(home.values()).values()) == [2, 2], home

    jobs = [name for name in ADAPTERS for _ in range(4)]
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda name: complete(cluster, name), jobs))
    served = defaultdict(set)
    for name, response in zip(jobs, replies, strict=True):
        assert response.status_code == 200, response.text
        served[name].add(response.headers[REPLICA])
        # The replica held the adapter already: nothing read again.
        assert response.headers["x-loraserve-adapter-read"] == "0"
    assert served == {name: {home[name]} for name in ADAPTERS}


def test_outputs_equal_a_single_server(cluster, single):
    for model in ("base", *ADAPTERS):
        ours, theirs = complete(cluster, model), complete(single.url, model)
        assert ours.status_code == theirs.status_code == 200, ours.text
        assert ours.headers[REPLICA]
        assert ([c["text"] for c in ours.json()["choices"]]
                == [c["text"] for c in theirs.json()["choices"]]), model
        assert ours.json()["usage"] == theirs.json()["usage"]
        assert chat_stream(cluster, model) == chat_stream(single.url, model), model
    for path, body in (("/tokenize", {"model": "r8", "prompt": PROMPT}),
                       ("/detokenize", {"model": "base", "tokens": [1, 2, 3]})):
        ours = httpx.post(cluster + path, json=body, timeout=60)
        assert ours.status_code == 200, ours.text
        assert ours.json() == httpx.post(single.url + path, json=body, timeout=60).json()


def test_errors_have_the_single_servers_shape(cluster, single):
    for body in ({"model": "nope", "prompt": "hi"},  # unknown model: 404
                 {"model": "r8", "prompt": "hi", "max_tokens": -1},  # invalid field: 400
                 {"model": "r8", "prompt": [10**9]}):  # token id off the vocabulary: 400
        ours = httpx.post(cluster + "/v1/completions", json=body, timeout=60)
        theirs = httpx.post(single.url + "/v1/completions", json=body, timeout=60)
        assert ours.status_code == theirs.status_code != 200, body
        assert ours.json() == theirs.json(), body


def test_runtime_load_and_unload_reach_every_replica(cluster, single, llama_adapters):
    load = {"lora_name": "runtime", "lora_path": llama_adapters["r8"]}
    response = httpx.post(cluster + "/v1/load_lora_adapter", json=load, timeout=60)
    assert response.status_code == 200, response.text
    assert all("runtime" in state["adapters"] for state in every_replica())
    assert "runtime" in {m["id"] for m in httpx.get(cluster + "/v1/models").json()["data"]}
    # Same weights as r8: the same answer.
    assert complete(cluster, "runtime").json()["choices"][0]["text"] == \
        complete(cluster, "r8").json()["choices"][0]["text"]

    again = httpx.post(cluster + "/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 400 and "already been loaded" in again.text
    missing = httpx.post(cluster + "/v1/load_lora_adapter", timeout=60,
                         json={"lora_name": "missing", "lora_path": "/nonexistent/adapter"})
    assert missing.status_code == 404, missing.text

    response = httpx.post(cluster + "/v1/unload_lora_adapter", json={"lora_name": "runtime"},
                          timeout=60)
    assert response.status_code == 200, response.text
    for state in every_replica():
        assert "runtime" not in state["adapters"] and "runtime" not in state["engine_adapters"]
    assert complete(cluster, "runtime").status_code == 404


def test_metrics_name_every_replica(cluster):
    def replicas_in_metrics() -> set[str]:
        text = httpx.get(cluster + "/metrics", timeout=10).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        info = families.get("loraserve:lora_requests_info")
        return {s.labels["replica"] for s in info.samples} if info else set()

    assert wait_until(lambda: len(replicas_in_metrics()) == 2, 20, 0.5)


def test_a_killed_replica_loses_no_retried_request(cluster):
    import ray

    def with_retries(name: str) -> httpx.Response:
        for _ in range(60):
            try:
                response = complete(cluster, name, max_tokens=24)
            except httpx.TransportError:
                response = None
            if response is not None and response.status_code < 500:
                return response
            time.sleep(0.5)
        raise AssertionError(f"{name}: no answer after 60 tries")

    expected = {name: complete(cluster, name, max_tokens=24).json()["choices"][0]["text"]
                for name in ADAPTERS}
    # A stream in flight on the replica when it goes: it ends with an error event.
    body = {"model": ADAPTERS[0], "prompt": PROMPT, "stream": True, **GREEDY,
            "max_tokens": 400}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=120) as stream:
        victim = stream.headers[REPLICA]
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        jobs = [name for _ in range(6) for name in ADAPTERS]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(with_retries, name) for name in jobs]
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            rest = [line for line in lines if line]
            replies = [future.result(timeout=300) for future in futures]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "retry" in error["message"]
    for name, response in zip(jobs, replies, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[name]
    # Ray Serve starts a replica in its place.
    assert wait_until(lambda: len(replica_states(20)) == 2, 120, 1.0)
    assert victim not in replica_states()


def test_serve_ray_flags_are_checked(tmp_path):
    from loraserve.cli_args import CLIError

    def check(*argv: str) -> None:
        validate_args(build_parser().parse_args(["serve-ray", "m", *argv]))

    for name in ("key.pem", "cert.pem"):
        (tmp_path / name).write_text("")
    with pytest.raises(CLIError, match="not available with serve-ray"):
        check("--ssl-keyfile", str(tmp_path / "key.pem"),
              "--ssl-certfile", str(tmp_path / "cert.pem"))
    with pytest.raises(CLIError, match="--max-replicas"):
        check("--num-replicas", "3", "--max-replicas", "2")
    check("--num-replicas", "2", "--max-replicas", "4")
