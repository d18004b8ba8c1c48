"""`loraserve serve-ray` as one command: it starts a Ray cluster of its own with the
application on it, serves an adapter, and on SIGTERM takes everything down and
exits with status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
from serve_utils import alive, descendants, free_port, wait_until

pytest.importorskip("ray.serve")


def test_serve_ray_serves_and_stops_on_sigterm(llama_dir, llama_adapters):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="loraserve-serve-ray-", suffix=".log",
                                      delete=False)
    env = {**os.environ, "LORASERVE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "loraserve.cli", "serve-ray", llama_dir, "--enable-lora",
         "--lora-modules", f"r8={llama_adapters['r8']}", "--num-replicas", "1",
         "--replica-num-cpus", "0.5", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    output = lambda: Path(log.name).read_text(errors="replace")[-4000:]  # noqa: E731

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None  # stop waiting; the asserts below say why

    started: set[int] = set()
    try:
        assert wait_until(healthy, 180, 0.5) and proc.poll() is None, output()
        started = set(descendants(proc.pid))  # the Ray cluster, its workers, the engines
        models = {m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]}
        assert models == {llama_dir, "r8"}
        response = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "r8", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
        assert response.status_code == 200, response.text
        assert response.headers["x-loraserve-replica"].startswith("SERVE_REPLICA::")

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, output()
        assert wait_until(lambda: not any(alive(pid) for pid in started), 30, 0.5), \
            sorted(pid for pid in started if alive(pid))
    finally:
        # A failed run leaves nothing behind either.
        for pid in [proc.pid, *started]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()
