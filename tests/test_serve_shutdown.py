"""Both processes stop cleanly: on SIGTERM/SIGINT within 10 s, when the engine
dies (the API answers 503, then stops unless told to keep alive), and when the
API server dies (the engine follows)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from serve_utils import ServerProcess, alive, wait_until

LONG = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0.0,
        "ignore_eos": True}


def base_server(llama_dir, env=None) -> ServerProcess:
    return ServerProcess([llama_dir, "--served-model-name", "base"], env=env)


def running_requests(server) -> int:
    stats = httpx.get(server.url + "/v1/engine_stats", timeout=5).json()
    return stats["scheduler"]["num_running"]


def start_long_stream(server) -> threading.Thread:
    def run() -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={"model": "base", "stream": True, **LONG},
                              timeout=30) as response:
                for _ in response.iter_lines():
                    pass
        except httpx.HTTPError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    time.sleep(0.5)
    return thread


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_every_process_within_10s(llama_dir, sig):
    server = base_server(llama_dir)
    try:
        engine = server.engine_pid()
        assert alive(engine)
        stream = start_long_stream(server)
        elapsed = server.stop(sig, timeout_s=10)
        assert elapsed < 10, server.output()
        assert server.all_gone() and not alive(engine)
        assert server.proc.returncode == 0, server.output()
        stream.join(timeout=10)
    finally:
        server.kill()


def test_a_new_request_during_the_drain_gets_503_while_those_in_flight_finish(llama_dir):
    # One sequence at a time: the streams taken before SIGTERM run one after another,
    # so the last of them runs for seconds into the drain.
    server = ServerProcess([llama_dir, "--served-model-name", "base", "--max-num-seqs", "1",
                            "--shutdown-timeout", "60"])
    try:
        results: list = []
        started = [threading.Event() for _ in range(6)]

        def stream(taken: threading.Event) -> None:
            with httpx.stream("POST", server.url + "/v1/completions",
                              json={"model": "base", "stream": True, **LONG},
                              timeout=60) as response:
                taken.set()  # headers: the server has taken it
                lines = [line for line in response.iter_lines() if line]
            results.append((response.status_code, lines))

        threads = [threading.Thread(target=stream, args=(e,), daemon=True) for e in started]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in started), server.output()
        server.proc.send_signal(signal.SIGTERM)

        def health_says_draining() -> bool:
            try:  # a new connection each time
                return httpx.get(server.url + "/health", timeout=5).status_code == 503
            except httpx.ConnectError:
                return False

        assert wait_until(health_says_draining, 10), server.output()
        refused = httpx.post(server.url + "/v1/completions", timeout=10,
                             json={"model": "base", "prompt": "hi", "max_tokens": 2})
        assert any(thread.is_alive() for thread in threads), "nothing was in flight"
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == 503 and "shutting down" in error["message"], error
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == len(threads), results
        for status, lines in results:  # every one taken before SIGTERM ran to its end
            assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
            assert '"finish_reason": "length"' in lines[-2], lines[-3:]
        assert wait_until(lambda: server.proc.poll() is not None, 30), server.output()
        assert server.proc.returncode == 0, server.output()
    finally:
        server.kill()


def test_ctrl_c_to_the_process_group_stops_cleanly(llama_dir):
    # Ctrl-C reaches the API server and the engine at once; neither may hang or
    # print a traceback while the other goes away.
    server = ServerProcess([llama_dir, "--served-model-name", "base"], new_session=True)
    try:
        stream = start_long_stream(server)
        elapsed = server.stop_group(signal.SIGINT, timeout_s=10)
        assert elapsed < 10 and server.all_gone(), server.output()
        assert server.proc.returncode == 0, server.output()
        assert "Traceback" not in server.output(), server.output()
        stream.join(timeout=10)
    finally:
        server.kill()


def test_engine_death_answers_503_and_sigterm_still_stops(llama_dir):
    server = base_server(llama_dir, env={"LORASERVE_KEEP_ALIVE_ON_ENGINE_DEATH": "true"})
    try:
        engine = server.engine_pid()
        result: dict = {}

        def in_flight() -> None:
            result["response"] = httpx.post(server.url + "/v1/completions",
                                            json={"model": "base", **LONG}, timeout=30)

        thread = threading.Thread(target=in_flight, daemon=True)
        thread.start()
        # Kill once the scheduler shows the request running, long before its 400
        # tokens are done (a fixed sleep races a fast engine and a slow one alike).
        assert wait_until(lambda: running_requests(server) >= 1, 20)
        os.kill(engine, signal.SIGKILL)
        thread.join(timeout=20)
        # The request that was running when the engine died is answered, with 503.
        assert result["response"].status_code == 503
        assert result["response"].json()["error"]["code"] == 503
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, 10)
        client = server.openai()
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="base", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        assert httpx.get(server.url + "/v1/models").status_code == 503
        assert server.proc.poll() is None  # kept alive, as asked
        assert server.stop(signal.SIGTERM) < 10
        assert server.all_gone()
    finally:
        server.kill()


def test_engine_death_stops_the_api_server(llama_dir):
    server = base_server(llama_dir)
    try:
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert wait_until(lambda: server.proc.poll() is not None, 10), server.output()
        assert server.proc.returncode != 0
        assert wait_until(server.all_gone, 5)
    finally:
        server.kill()


def test_api_server_death_stops_the_engine(llama_dir):
    server = base_server(llama_dir)
    try:
        engine = server.engine_pid()
        server.proc.kill()
        server.proc.wait(timeout=5)
        assert wait_until(lambda: not alive(engine), 10), "the engine outlived its parent"
        assert wait_until(server.all_gone, 5)
    finally:
        server.kill()


def test_sigterm_while_the_model_loads(llama_dir):
    import subprocess

    from serve_utils import descendants, free_port, serve_command

    proc = subprocess.Popen(
        serve_command() + [llama_dir, "--host", "127.0.0.1", "--port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    try:
        # As soon as the engine process exists, before it is ready.
        assert wait_until(lambda: descendants(proc.pid), 60, 0.01)
        pids = descendants(proc.pid)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - start < 5
        assert wait_until(lambda: not any(alive(p) for p in pids), 5)
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
