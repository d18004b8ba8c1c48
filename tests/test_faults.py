"""Faults a server must ride out, each with its expected outcome: corrupt
adapters loaded at run time (a clear 400; everything else keeps serving), an
adapter whose read raises or blocks forever (others are served meanwhile), a
client that goes away mid-stream (its request is aborted in the engine), the
engine process killed (in-flight requests get a 503 in OpenAI's shape; the API
server exits non-zero, or keeps answering 503 when told to), a tensor-parallel
rank killed (the same: the engine stops, never a 4xx), and SIGTERM under
load (every request is answered in full or with an OpenAI-shaped 503, then the
server exits 0 in bounded time and takes its engine along)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fault_utils import (
    Reply,
    assert_complete,
    assert_openai_error,
    call,
    chat_body,
    completion_body,
    engine_stats,
    leftover_ipc_dirs,
    outcome,
    start_server,
    token_ids,
    wait_engine_idle,
)
from safetensors.torch import load_file, save_file
from serve_utils import alive, children, wait_until
from utils import make_peft_adapter

PROMPT = "The quick brown fox"
MAX_TOKENS = 6
# Long enough to be still running when the fault hits.
LONG_TOKENS = 300
WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
# How long requests that must not wait for a stuck adapter load may take.
UNSTALLED_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 15.0
RUNTIME_LORA = {"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def pipe_adapter(workdir, llama_adapters) -> str:
    """A start-up adapter whose weights file a test swaps for a named pipe."""
    path = workdir / "pipe"
    shutil.copytree(llama_adapters["r16_qv"], path)
    return str(path)


@pytest.fixture(scope="module")
def server(llama_dir, llama_adapters, pipe_adapter):
    # Room for two adapters in CPU memory: `pipe`, the first of three, is evicted at
    # start-up, so its next request reads it from disk again.
    with start_server(
        [llama_dir, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
         "--max-cpu-loras", "2", "--max-lora-rank", "16", "--max-num-seqs", "8",
         "--lora-modules", f"pipe={pipe_adapter}", f"good={llama_adapters['r8']}",
         f"other={llama_adapters['r1']}"],
        env=RUNTIME_LORA,
    ) as srv:
        yield srv


def complete(server, model: str, stream: bool = False,
             timeout: float = UNSTALLED_TIMEOUT_S) -> Reply:
    return call(server.url, "/v1/completions",
                completion_body(model, PROMPT, MAX_TOKENS, stream), timeout=timeout)


def tokens_of(reply: Reply) -> list[int]:
    return token_ids(reply)[0]


@pytest.fixture(scope="module")
def reference(server) -> dict[str, list[int]]:
    """What each model answers before any fault."""
    ref = {model: tokens_of(complete(server, model)) for model in ("base", "good", "other")}
    ref["pipe"] = tokens_of(complete(server, "pipe"))
    assert len({tuple(tokens) for tokens in ref.values()}) == len(ref), ref
    return ref


def assert_still_serving(server, reference: dict[str, list[int]],
                         models: tuple[str, ...] = ("base", "good", "other")) -> None:
    """Every model answers as before, streamed and not, at the same time."""
    with ThreadPoolExecutor(2 * len(models)) as pool:
        jobs = {(m, s): pool.submit(complete, server, m, s)
                for m in models for s in (False, True)}
    for (model, _), job in jobs.items():
        assert tokens_of(job.result()) == reference[model], (model, job.result().describe())


# ---- corrupt adapters ---------------------------------------------------------------


def _copy(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# Each builder writes a broken copy of adapter `src` (of the model in model_dir) to dst.
Builder = Callable[[str, Path, str], None]


def _truncated(src: str, dst: Path, model_dir: str) -> None:
    weights = _copy(src, dst) / WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])


def _garbage_config(src: str, dst: Path, model_dir: str) -> None:
    (_copy(src, dst) / CONFIG).write_text('{"r": 8, "lora_alpha": 16, "target_modu')


def _config_not_an_object(src: str, dst: Path, model_dir: str) -> None:
    (_copy(src, dst) / CONFIG).write_text("[8, 16]")


def _with_config(**fields) -> Builder:
    def build(src: str, dst: Path, model_dir: str) -> None:
        config_path = _copy(src, dst) / CONFIG
        config = json.loads(config_path.read_text())
        config.update(fields)
        # json writes NaN as the bare word, which Python's (and PEFT's) reader takes.
        config_path.write_text(json.dumps(config))

    return build


def _poisoned(value: float, which: str) -> Builder:
    """One lora_A or lora_B tensor with a non-finite entry."""
    def build(src: str, dst: Path, model_dir: str) -> None:
        weights = _copy(src, dst) / WEIGHTS
        tensors = load_file(str(weights))
        key = next(k for k in sorted(tensors) if f"lora_{which}" in k)
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = value
        save_file(tensors, str(weights), metadata={"format": "pt"})

    return build


def _weights_are_a_directory(src: str, dst: Path, model_dir: str) -> None:
    # The read raises (IsADirectoryError or the like) instead of returning bytes.
    weights = _copy(src, dst) / WEIGHTS
    weights.unlink()
    weights.mkdir()
    (weights / "part0").write_bytes(b"\0" * 64)


def _rank_above_max(src: str, dst: Path, model_dir: str) -> None:
    make_peft_adapter(model_dir, dst, r=32, alpha=32, seed=9)  # --max-lora-rank is 16


CORRUPT: dict[str, Builder] = {
    "truncated-safetensors": _truncated,
    "garbage-json-config": _garbage_config,
    "config-not-an-object": _config_not_an_object,
    "nan-weights": _poisoned(float("nan"), "B"),
    "inf-weights": _poisoned(float("inf"), "A"),
    "nan-alpha": _with_config(lora_alpha=float("nan")),
    "rank-above-max": _rank_above_max,
    "weights-are-a-directory": _weights_are_a_directory,
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_corrupt_adapter_is_refused_and_the_rest_keeps_serving(server, reference, workdir,
                                                             llama_dir, llama_adapters, kind):
    path = workdir / f"bad-{kind}"
    CORRUPT[kind](llama_adapters["r8"], path, llama_dir)
    name = f"bad-{kind}"
    reply = call(server.url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert reply.status == 400, reply.describe()
    error = assert_openai_error(reply.body, 400)
    assert name in error["message"], error
    assert name not in {m["id"] for m in server.get("/v1/models").json()["data"]}
    refused = complete(server, name)
    assert refused.status == 404, refused.describe()
    assert_openai_error(refused.body, 404)
    assert_still_serving(server, reference)


# ---- client disconnects ---------------------------------------------------------------


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", completion_body("good", PROMPT, 400, stream=True, n=2)),
    ("/v1/chat/completions", chat_body("other", PROMPT, 400, stream=True)),
], ids=["completion-n2", "chat"])
def test_client_disconnect_mid_stream_aborts_the_request(server, reference, path, body):
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: {")
            if events >= 3:
                break
    # Closing the connection aborts the request in the engine and frees its blocks.
    assert wait_engine_idle(server, 10), engine_stats(server)
    assert_still_serving(server, reference)


def test_client_disconnect_while_waiting_for_a_full_answer(server, reference):
    body = completion_body("good", PROMPT, 400, n=2)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body,
                   timeout=httpx.Timeout(30, read=0.5))
    assert wait_engine_idle(server, 10), engine_stats(server)
    assert_still_serving(server, reference)


# ---- adapter reads that never return ----------------------------------------------------


def _release(pipe: Path, data: bytes, timeout_s: float = 10.0) -> None:
    """Write data into the pipe if a reader is blocked on it; otherwise nothing. The
    writes never block for long: a reader that stops reading is left behind."""
    try:
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # nobody is reading: the load did not block
            return
        raise
    deadline = time.monotonic() + timeout_s
    view = memoryview(data)
    try:
        while view and time.monotonic() < deadline:
            try:
                view = view[os.write(fd, view[:65536]):]
            except BlockingIOError:
                time.sleep(0.01)
            except BrokenPipeError:
                return  # the reader gave up on the pipe (it cannot be mapped)
    finally:
        os.close(fd)


@contextmanager
def file_as_a_pipe(adapter_dir: Path, name: str = WEIGHTS) -> Iterator[Path]:
    """Swap one of the adapter's files for a named pipe that nobody writes: a read
    of it blocks for real. On the way out the pipe gets the real bytes (so a
    blocked read ends) and the file comes back."""
    path = adapter_dir / name
    data = path.read_bytes()
    path.unlink()
    os.mkfifo(path)
    try:
        yield path
    finally:
        _release(path, data)
        path.unlink()
        path.write_bytes(data)


def _assert_served_while_stuck(server, reference, stuck: Future) -> None:
    """Base and the other adapters answer in full while the stuck request waits, and
    so do the endpoints that only ask the engine."""
    time.sleep(1.0)  # time for the load to reach the pipe
    assert_still_serving(server, reference)
    assert server.get("/health").status_code == 200
    assert server.get("/v1/models").status_code == 200
    assert server.get("/v1/engine_stats").status_code == 200
    # The stuck request itself waits, or was refused with a clear 4xx by a server
    # that does not read a pipe; it never takes a 5xx.
    if stuck.done():
        reply = stuck.result()
        assert reply.status is not None and 400 <= reply.status < 500, reply.describe()
        assert_openai_error(reply.body, reply.status)


def _assert_finished_after_release(stuck: Future, expect_ok: Callable[[Reply], None]) -> None:
    """Once the pipe has a writer, the request ends: served (the read took the bytes)
    or a clear 4xx naming the problem (a pipe cannot be memory-mapped)."""
    reply = stuck.result(timeout=UNSTALLED_TIMEOUT_S)
    assert reply.exception is None and reply.status is not None, reply.describe()
    if reply.status == 200:
        expect_ok(reply)
    else:
        assert 400 <= reply.status < 500, reply.describe()
        assert_openai_error(reply.body, reply.status)


@pytest.mark.parametrize("blocking_file", [WEIGHTS, CONFIG])
def test_runtime_load_that_blocks_does_not_stall_other_requests(server, reference, workdir,
                                                              llama_adapters, blocking_file):
    name = f"blocking-{blocking_file.split('.')[0]}"
    adapter = _copy(llama_adapters["r8"], workdir / name)
    body = {"lora_name": name, "lora_path": str(adapter)}
    with ThreadPoolExecutor(1) as pool:
        with file_as_a_pipe(adapter, blocking_file):
            stuck = pool.submit(call, server.url, "/v1/load_lora_adapter", body, timeout=120)
            _assert_served_while_stuck(server, reference, stuck)

        def loaded(_: Reply) -> None:
            # The same weights as `good`, so the same tokens.
            assert tokens_of(complete(server, name)) == reference["good"]

        _assert_finished_after_release(stuck, loaded)
    assert wait_engine_idle(server, 10), engine_stats(server)


def test_request_whose_adapter_read_blocks_does_not_stall_others(server, reference,
                                                               pipe_adapter):
    # `pipe` must come from disk: two other adapters fill the CPU cache first.
    for model in ("good", "other"):
        assert_complete(complete(server, model))
    assert "pipe" not in engine_stats(server)["scheduler"]["cpu_lora_adapters"]
    with ThreadPoolExecutor(1) as pool:
        with file_as_a_pipe(Path(pipe_adapter)):
            stuck = pool.submit(complete, server, "pipe", False, 120)
            _assert_served_while_stuck(server, reference, stuck)

        def served(reply: Reply) -> None:
            assert tokens_of(reply) == reference["pipe"]

        _assert_finished_after_release(stuck, served)
    assert wait_engine_idle(server, 10), engine_stats(server)
    assert_still_serving(server, reference, ("base", "good", "pipe"))


# ---- the engine process dies --------------------------------------------------------------


def _in_flight_bodies(models: tuple[str, ...]) -> list[tuple[str, dict]]:
    """Long requests of every kind: streamed and not, completions and chat."""
    bodies = []
    for i, model in enumerate(models):
        stream = i % 2 == 0
        bodies.append(("/v1/completions", completion_body(model, PROMPT, LONG_TOKENS, stream)))
        bodies.append(("/v1/chat/completions",
                       chat_body(model, PROMPT, LONG_TOKENS, not stream)))
    return bodies


def _start_in_flight(server, pool: ThreadPoolExecutor,
                     bodies: list[tuple[str, dict]]) -> list[Future]:
    """Send the requests and wait until the engine holds every one of them."""
    futures = [pool.submit(call, server.url, path, body, timeout=60) for path, body in bodies]

    def all_in_engine() -> bool:
        stats = engine_stats(server)["scheduler"]
        return stats["num_running"] + stats["num_waiting"] == len(bodies)

    assert wait_until(all_in_engine, 30, 0.02), engine_stats(server)
    return futures


def _collect(futures: list[Future]) -> list[Reply]:
    _, not_done = wait(futures, timeout=60)
    assert not not_done, f"{len(not_done)} in-flight requests were never answered"
    return [f.result() for f in futures]


def _engine_death_server(llama_dir, llama_adapters, tmp_dir: Path, keep_alive: bool):
    env = {**RUNTIME_LORA, "TMPDIR": str(tmp_dir)}
    if keep_alive:
        env["LORASERVE_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"
    return start_server(
        [llama_dir, "--served-model-name", "base", "--enable-lora", "--max-num-seqs", "8",
         "--lora-modules", f"good={llama_adapters['r8']}"], env=env)


@pytest.mark.parametrize("keep_alive", [False, True], ids=["exits", "keep-alive"])
def test_engine_killed_answers_in_flight_with_503(llama_dir, llama_adapters, tmp_path,
                                                  keep_alive):
    server = _engine_death_server(llama_dir, llama_adapters, tmp_path, keep_alive)
    try:
        engine = server.engine_pid()
        bodies = _in_flight_bodies(("base", "good", "base"))
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = _start_in_flight(server, pool, bodies)
            os.kill(engine, signal.SIGKILL)
            replies = _collect(futures)
        # Each one gets an OpenAI-shaped 503: the status before any output, or an
        # error event that ends a started stream (then [DONE]).
        for (path, body), reply in zip(bodies, replies, strict=True):
            assert outcome(reply, error_codes={503}) == "error", (path, body, reply.describe())
        if not keep_alive:
            assert wait_until(lambda: server.proc.poll() is not None, EXIT_TIMEOUT_S), \
                server.output()
            assert server.proc.returncode != 0, server.output()
        else:
            assert server.proc.poll() is None, server.output()
            assert server.get("/health").status_code == 503
            for path, body in _in_flight_bodies(("base", "good")):
                late = call(server.url, path, body, timeout=10)
                assert late.status == 503, late.describe()
                assert_openai_error(late.body, 503)
            models = server.get("/v1/models")
            assert models.status_code == 503
            assert_openai_error(models.json(), 503)
            server.proc.send_signal(signal.SIGTERM)
            assert wait_until(lambda: server.proc.poll() is not None, EXIT_TIMEOUT_S), \
                server.output()
        assert wait_until(server.all_gone, 5), server.output()
        assert not leftover_ipc_dirs(tmp_path), leftover_ipc_dirs(tmp_path)
    finally:
        server.kill()


# ---- a tensor-parallel rank dies ---------------------------------------------------------


def _tp_worker(engine_pid: int) -> int:
    """Rank 1, spawned by the engine-core process (rank 0)."""
    workers = [pid for pid in children(engine_pid)
               if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(workers) == 1, workers
    return workers[0]


def _assert_no_internals(reply: Reply) -> None:
    for leak in ("gloo", "pair.cc", "collective", "tensor-parallel", "Traceback"):
        assert leak not in reply.text, reply.describe()


@pytest.mark.parametrize("keep_alive", [False, True], ids=["under-load-exits", "idle-keep-alive"])
def test_tensor_parallel_rank_killed_stops_the_engine(llama_dir, llama_adapters, tmp_path,
                                                      keep_alive):
    """kill -9 of rank 1 is the engine's death, not the requests' fault: under load
    (a collective fails mid-step) every request in flight gets a 503 and the server
    exits non-zero; while idle (only the process's exit tells) /health turns 503
    and so does every request, with the keep-alive switch. Either way the log names
    the rank, and no step is retried request by request."""
    env = {"TMPDIR": str(tmp_path)}
    if keep_alive:
        env["LORASERVE_KEEP_ALIVE_ON_ENGINE_DEATH"] = "1"
    server = start_server(
        [llama_dir, "--served-model-name", "base", "--tensor-parallel-size", "2",
         "--enable-lora", "--max-num-seqs", "8", "--lora-modules",
         f"good={llama_adapters['r8']}"], env=env)
    try:
        worker = _tp_worker(server.engine_pid())
        if keep_alive:
            os.kill(worker, signal.SIGKILL)
            assert wait_until(lambda: server.get("/health").status_code == 503, 10), \
                server.output()
            replies = [call(server.url, path, body, timeout=10)
                       for path, body in _in_flight_bodies(("base", "good"))]
            for reply in replies:
                assert reply.status == 503, reply.describe()
            assert server.proc.poll() is None, server.output()
            server.proc.send_signal(signal.SIGTERM)
        else:
            bodies = _in_flight_bodies(("base", "good", "base"))
            with ThreadPoolExecutor(len(bodies)) as pool:
                futures = _start_in_flight(server, pool, bodies)
                os.kill(worker, signal.SIGKILL)
                replies = _collect(futures)
        for reply in replies:
            assert outcome(reply, error_codes={503}) == "error", reply.describe()
            _assert_no_internals(reply)
        assert wait_until(lambda: server.proc.poll() is not None, EXIT_TIMEOUT_S), \
            server.output()
        assert server.proc.returncode == (0 if keep_alive else 1), server.output()
        assert wait_until(server.all_gone, 5), server.output()
        log = server.output()
        assert f"tensor-parallel rank 1 (pid {worker}) died: killed by SIGKILL" in log, log
        assert "retrying each alone" not in log and "fails on its own" not in log, log
    finally:
        server.kill()


# ---- SIGTERM under load -------------------------------------------------------------------


def test_sigterm_under_load_answers_everything_and_exits_0(llama_dir, llama_adapters,
                                                           tmp_path):
    server = start_server(
        [llama_dir, "--served-model-name", "base", "--enable-lora", "--max-num-seqs", "16",
         "--lora-modules", f"good={llama_adapters['r8']}"],
        env={"TMPDIR": str(tmp_path)})
    try:
        engine = server.engine_pid()
        bodies = _in_flight_bodies(("base", "good", "base", "good"))
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = _start_in_flight(server, pool, bodies)
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(timeout=EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass  # reported by the assert below
            exited = server.proc.poll()
            replies = _collect(futures)
        assert exited is not None, f"still running {EXIT_TIMEOUT_S} s after SIGTERM"
        assert exited == 0, server.output()
        assert wait_until(lambda: not alive(engine), 5), "the engine outlived the server"
        assert wait_until(server.all_gone, 5)
        # Each request was answered in full, or with an OpenAI-shaped 503 (a stream:
        # an error event, then [DONE]); none was cut off or left hanging.
        problems = []
        for (path, body), reply in zip(bodies, replies, strict=True):
            try:
                outcome(reply, error_codes={503})
            except AssertionError as exc:
                problems.append((path, body["model"], body["stream"], str(exc)[:400]))
        assert not problems, problems
        assert not leftover_ipc_dirs(tmp_path), leftover_ipc_dirs(tmp_path)
    finally:
        server.kill()
