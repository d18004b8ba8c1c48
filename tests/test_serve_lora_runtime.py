"""Adapters at run time: background loading that never stalls other streams, load
failures that fail only their own requests, /v1/load_lora_adapter and
/v1/unload_lora_adapter with vLLM's status codes, unload freeing the engine's
memory, and the filesystem resolver."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from serve_utils import ServerProcess
from utils import hf_greedy, make_peft_adapter

PROMPT = "The quick brown fox"
MAX_TOKENS = 6
SLOW_LOAD_S = 3.0


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_runtime")


class SlowConfig:
    """An adapter copy whose adapter_config.json is a named pipe: each read of it
    blocks until `delay` seconds after the reader opened it, a disk read as slow
    as a real one from a network share. (The weights cannot be the pipe:
    safetensors maps its file into memory, and a pipe cannot be mapped.)"""

    def __init__(self, src: str, dst: Path) -> None:
        shutil.copytree(src, dst)
        self.path = dst / "adapter_config.json"
        self.content = self.path.read_bytes()
        self.path.unlink()
        os.mkfifo(self.path)
        self.dir = str(dst)
        self.delay = 0.0  # start-up reads it at once
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._serve, daemon=True)
        self._writer.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                with open(self.path, "wb") as pipe:  # waits for a reader
                    if self._stop.is_set():
                        return
                    time.sleep(self.delay)
                    pipe.write(self.content)
            except BrokenPipeError:
                pass  # the reader gave up; serve the next one
            # The next reader gets a pipe of its own: writing the next copy into this
            # one would reach the reader still on it before its end of file.
            fresh = self.path.with_name(self.path.name + ".next")
            os.mkfifo(fresh)
            os.replace(fresh, self.path)

    def close(self) -> None:
        self._stop.set()
        # A writer waiting for a reader wakes when one opens the pipe.
        os.close(os.open(self.path, os.O_RDONLY | os.O_NONBLOCK))
        self._writer.join(timeout=10)


@pytest.fixture(scope="module")
def slow_adapters(workdir, llama_adapters) -> dict[str, SlowConfig]:
    slow = {"slow": SlowConfig(llama_adapters["r16_qv"], workdir / "slow"),
            "slowrt": SlowConfig(llama_adapters["r1"], workdir / "slowrt")}
    yield slow
    for adapter in slow.values():
        adapter.close()


@pytest.fixture(scope="module")
def fragile(workdir, llama_adapters) -> str:
    path = workdir / "fragile"
    shutil.copytree(llama_adapters["r8"], path)
    return str(path)


@pytest.fixture(scope="module")
def resolver_dir(workdir, llama_adapters) -> str:
    root = workdir / "resolver_cache"
    root.mkdir()
    shutil.copytree(llama_adapters["r1"], root / "fsres")
    return str(root)


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters, fragile, resolver_dir, slow_adapters):
    # Four start-up adapters and room for two in CPU memory: the first two are read
    # at start-up, `fragile` and `slow` only registered, so their first requests
    # load them in the background.
    with ServerProcess(
        [
            llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "2",
            "--served-model-name", "base",
            "--lora-modules", f"a1={llama_adapters['r8']}", f"a3={llama_adapters['r1']}",
            f"fragile={fragile}", f"slow={slow_adapters['slow'].dir}",
        ],
        env={
            "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true",
            "LORASERVE_LORA_RESOLVER_CACHE_DIR": resolver_dir,
        },
    ) as srv:
        # From now on every read of the slow adapters takes SLOW_LOAD_S.
        for adapter in slow_adapters.values():
            adapter.delay = SLOW_LOAD_S
        yield srv


@pytest.fixture(scope="module")
def reference(llama_dir, llama_adapters) -> dict[str, list[int]]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPT).input_ids
    return {name: hf_greedy(llama_dir, llama_adapters[name], ids, MAX_TOKENS)
            for name in ("r8", "r16_qv", "r1")}


def complete(server, model: str) -> httpx.Response:
    return server.post("/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True,
    })


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def engine_stats(server) -> dict:
    return server.get("/v1/engine_stats").json()


def stream_while(server, action):
    """Stream from adapter a1 in a loop while action() runs; returns action's result,
    its start and end times, and the arrival time of every streamed token."""
    stamps: list[float] = []
    stop = threading.Event()

    def stream_a1() -> None:
        body = {"model": "a1", "prompt": PROMPT, "max_tokens": 24, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        while not stop.is_set():
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        stamps.append(time.monotonic())

    streamer = threading.Thread(target=stream_a1, daemon=True)
    streamer.start()
    try:
        deadline = time.monotonic() + 60
        while len(stamps) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(stamps) >= 5, server.output()
        t0 = time.monotonic()
        result = action()
        t1 = time.monotonic()
    finally:
        stop.set()
        streamer.join(timeout=60)
    return result, t0, t1, stamps


def assert_no_stall(t0: float, t1: float, stamps: list[float]) -> None:
    assert t1 - t0 >= SLOW_LOAD_S * 0.9, "the adapter's read was not slow"
    during = [t for t in stamps if t0 <= t <= t0 + SLOW_LOAD_S]
    assert len(during) >= 10, f"only {len(during)} tokens while the adapter loaded"
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"


def test_slow_adapter_load_does_not_stall_other_streams(server, reference):
    cached = engine_stats(server)["scheduler"]["cpu_lora_adapters"]
    assert "slow" not in cached and "fragile" not in cached
    response, t0, t1, stamps = stream_while(server, lambda: complete(server, "slow"))
    assert token_ids(response) == reference["r16_qv"]
    assert_no_stall(t0, t1, stamps)


def test_slow_runtime_load_does_not_stall_other_streams(server, slow_adapters, reference):
    body = {"lora_name": "slowrt", "lora_path": slow_adapters["slowrt"].dir}
    response, t0, t1, stamps = stream_while(
        server, lambda: server.post("/v1/load_lora_adapter", body))
    assert response.status_code == 200, response.text
    assert_no_stall(t0, t1, stamps)
    assert token_ids(complete(server, "slowrt")) == reference["r1"]


def test_failed_background_load_fails_only_its_requests(server, fragile, reference):
    with open(f"{fragile}/adapter_model.safetensors", "wb") as f:
        f.write(b"this is not a safetensors file")
    response = complete(server, "fragile")
    assert response.status_code == 400
    assert "fragile" in response.json()["error"]["message"]
    assert token_ids(complete(server, "a1")) == reference["r8"]


def test_load_use_and_unload_round_trip(server, llama_adapters, reference):
    r8, r16 = llama_adapters["r8"], llama_adapters["r16_qv"]
    response = server.post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": r8})
    assert response.status_code == 200, response.text
    assert "rt" in response.text
    models = {m["id"]: m for m in server.get("/v1/models").json()["data"]}
    assert models["rt"]["root"] == r8 and models["rt"]["parent"] == "base"
    # A loaded adapter is activated at once: it holds a device slot already.
    stats = engine_stats(server)
    assert "rt" in stats["scheduler"]["gpu_lora_adapters"]
    assert token_ids(complete(server, "rt")) == reference["r8"]

    duplicate = server.post("/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": r16})
    assert duplicate.status_code == 400
    assert "already" in duplicate.json()["error"]["message"]

    inplace = server.post("/v1/load_lora_adapter",
                          {"lora_name": "rt", "lora_path": r16, "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert token_ids(complete(server, "rt")) == reference["r16_qv"]

    memory = engine_stats(server)["lora_memory_bytes"]
    assert memory.get("rt", 0) > 0
    unload = server.post("/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert unload.status_code == 200, unload.text
    stats = engine_stats(server)
    assert "rt" not in stats["lora_memory_bytes"]
    assert "rt" not in stats["scheduler"]["cpu_lora_adapters"]
    assert "rt" not in stats["scheduler"]["gpu_lora_adapters"]
    assert "rt" not in {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert complete(server, "rt").status_code == 404
    again = server.post("/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert again.status_code == 404
    assert again.json()["error"]["type"] == "NotFoundError"


def test_bad_adapters_are_refused_with_the_reason(server, workdir, llama_dir):
    missing = server.post("/v1/load_lora_adapter",
                          {"lora_name": "ghost", "lora_path": str(workdir / "nowhere")})
    assert missing.status_code == 404  # vLLM: "No adapter found for ..."
    assert "ghost" in missing.json()["error"]["message"]
    big = make_peft_adapter(llama_dir, workdir / "r32", r=32, alpha=32, seed=7)
    too_big = server.post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": big})
    assert too_big.status_code == 400
    assert "rank" in too_big.json()["error"]["message"].lower()
    names = {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert "ghost" not in names and "big" not in names
    assert server.post("/v1/load_lora_adapter", {"lora_name": "x"}).status_code == 400
    assert server.post("/v1/load_lora_adapter",
                       {"lora_name": "base", "lora_path": big}).status_code == 400
    assert server.post("/v1/unload_lora_adapter", {}).status_code == 400


def test_filesystem_resolver_finds_unknown_names(server, reference):
    assert token_ids(complete(server, "fsres")) == reference["r1"]
    assert "LoRA adapter fsres found by resolver FilesystemResolver" in server.output()
    assert "fsres" in {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert complete(server, "not-in-cache").status_code == 404
    assert complete(server, "../fsres").status_code == 404


def test_runtime_pin_holds_its_slot_and_leaves_one_to_the_others(server, llama_adapters,
                                                                 reference):
    path = llama_adapters["r8"]
    pin = server.post("/v1/load_lora_adapter",
                      {"lora_name": "pinrt", "lora_path": path, "pinned": True})
    assert pin.status_code == 200, pin.text
    try:
        assert engine_stats(server)["scheduler"]["pinned_lora_adapters"] == ["pinrt"]
        # A second pin would hold the last of the two slots (--max-loras 2) for good.
        second = server.post("/v1/load_lora_adapter", {
            "lora_name": "pinrt2", "lora_path": llama_adapters["r1"], "pinned": True})
        assert second.status_code == 400, second.text
        error = second.json()["error"]
        assert error["param"] == "pinned"
        assert "would leave all 2 device slots" in error["message"]
        assert "pinrt2" not in {m["id"] for m in server.get("/v1/models").json()["data"]}
        # Two other adapters take turns in the slot left; the pinned one keeps its own.
        assert token_ids(complete(server, "a1")) == reference["r8"]
        assert token_ids(complete(server, "a3")) == reference["r1"]
        stats = engine_stats(server)["scheduler"]
        assert set(stats["gpu_lora_adapters"]) == {"pinrt", "a3"}
        assert token_ids(complete(server, "pinrt")) == reference["r8"]
    finally:
        unload = server.post("/v1/unload_lora_adapter", {"lora_name": "pinrt"})
    assert unload.status_code == 200, unload.text
    assert engine_stats(server)["scheduler"]["pinned_lora_adapters"] == []
    log = server.output()
    assert f"LoRA adapter pinrt loaded from {path} at run time (pinned)" in log
    assert "LoRA adapter pinrt unloaded" in log


def test_adapter_names_are_bounded(server, resolver_dir, llama_adapters):
    for name in ("x" * 256, "x" * 10_000, "has space", "naïve", "semi;colon"):
        response = server.post("/v1/load_lora_adapter",
                               {"lora_name": name, "lora_path": llama_adapters["r1"]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "lora_name" and "up to 255 characters" in error["message"]
    names = {m["id"] for m in server.get("/v1/models").json()["data"]}
    assert not [n for n in names if len(n) > 255 or " " in n]
    # A name no adapter may have is an unknown model: no resolver is asked, even
    # one that has a folder of that name.
    shutil.copytree(llama_adapters["r1"], Path(resolver_dir) / "fs res")
    assert complete(server, "fs res").status_code == 404
    assert complete(server, "x" * 1_000_000).status_code == 404
    # Names as Hub repos and versions have them are fine.
    ok = server.post("/v1/load_lora_adapter",
                     {"lora_name": "org/adapter-v1.2:main@2+b", "lora_path": llama_adapters["r1"]})
    assert ok.status_code == 200, ok.text
    assert server.post("/v1/unload_lora_adapter",
                       {"lora_name": "org/adapter-v1.2:main@2+b"}).status_code == 200
