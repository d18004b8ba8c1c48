"""`loraserve serve-ray` as one command: it starts a Ray cluster of its own with the
application on it and serves an adapter; a client that drops a stream is quiet
in the log, as under `loraserve serve`; and on SIGTERM it takes everything down
within seconds (no deployment waits out a drain loop, nor the registry its own
long polls) and exits with status 0."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from serve_utils import alive, descendants, free_port, wait_until

pytest.importorskip("ray.serve")

DISCONNECTS = 12
STOP_CEILING_S = 10.0
# From "Removing 1 replica from" a deployment to its replica "is stopped".
DEPLOYMENT_STOP_S = 1.5
_CONTROLLER_LINE = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) controller .*?(?:"
    r"Removing 1 replica from Deployment\(name='(\w+)'|deployment='(\w+)'.*? is stopped)")


class ServeRay:
    """One `loraserve serve-ray` subprocess with its own Ray cluster."""

    def __init__(self, args: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="loraserve-serve-ray-", suffix=".log",
                                               delete=False)
        env = {**os.environ, "LORASERVE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loraserve.cli", "serve-ray", *args, "--num-replicas", "1",
             "--replica-num-cpus", "0.5", "--host", "127.0.0.1", "--port", str(self.port)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        self.started: set[int] = set()

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return self.proc.poll() is not None  # stop waiting; the asserts say why

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.started]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture(scope="module")
def serve_ray(llama_dir, llama_adapters):
    server = ServeRay([llama_dir, "--enable-lora",
                       "--lora-modules", f"r8={llama_adapters['r8']}"])
    try:
        assert wait_until(server.healthy, 180, 0.5) and server.proc.poll() is None, \
            server.output()[-4000:]
        # The Ray cluster, its workers, the engines.
        server.started = set(descendants(server.proc.pid))
        yield server
    finally:
        # A failed run leaves nothing behind either.
        server.kill()


def test_serve_ray_serves(serve_ray, llama_dir):
    models = {m["id"] for m in httpx.get(serve_ray.url + "/v1/models", timeout=10).json()["data"]}
    assert models == {llama_dir, "r8"}
    response = httpx.post(serve_ray.url + "/v1/completions", timeout=120, json={
        "model": "r8", "prompt": "Hello", "max_tokens": 4, "temperature": 0.0})
    assert response.status_code == 200, response.text
    assert response.headers["x-loraserve-replica"].startswith("SERVE_REPLICA::")


def test_a_client_that_drops_a_stream_is_quiet(serve_ray, llama_dir):
    """Ray Serve reports the dropped client to the app as a cancelled fetch rather
    than http.disconnect, in a race with cancelling the request: it must read as
    a disconnect either way, and the request still leaves the engine."""
    start = len(serve_ray.output())
    for i in range(DISCONNECTS):
        body = {"model": ("r8", llama_dir)[i % 2], "prompt": "Hello", "max_tokens": 400,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", serve_ray.url + "/v1/completions", json=body,
                          timeout=60) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events >= 1 + 5 * (i % 3):
                    break  # closes the connection mid-stream

    def engine_idle() -> bool:
        stats = httpx.get(serve_ray.url + "/v1/engine_stats", timeout=10).json()["scheduler"]
        return stats["num_running"] + stats["num_waiting"] == 0

    assert wait_until(engine_idle, 30, 0.2)
    time.sleep(2)  # what the actors print reaches the driver's log late
    log = serve_ray.output()[start:]
    for noise in ("unexpected error", "Traceback", "TaskCancelledError"):
        assert noise not in log, log[-6000:]


def test_sigterm_stops_everything_within_seconds(serve_ray):
    start = time.monotonic()
    serve_ray.proc.send_signal(signal.SIGTERM)
    assert serve_ray.proc.wait(timeout=90) == 0, serve_ray.output()[-4000:]
    took = time.monotonic() - start
    assert wait_until(lambda: not any(alive(pid) for pid in serve_ray.started), 30, 0.5), \
        sorted(pid for pid in serve_ray.started if alive(pid))
    log = serve_ray.output()
    # Each deployment stops as soon as it has no request of a client left.
    removing: dict[str, datetime] = {}
    stopped: dict[str, float] = {}
    for stamp, removed, done in _CONTROLLER_LINE.findall(log):
        when = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")
        if removed:
            removing[removed] = when
        elif done in removing:
            stopped[done] = (when - removing[done]).total_seconds()
    assert set(stopped) == {"Ingress", "EngineReplica", "AdapterRegistry"}, log[-4000:]
    assert all(s < DEPLOYMENT_STOP_S for s in stopped.values()), stopped
    assert took < STOP_CEILING_S, (took, stopped)
