"""Helpers for the serving tests: run `loraserve serve` as a subprocess, find its
processes, and wait with bounded timeouts."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_command() -> list[str]:
    script = shutil.which("loraserve")
    return [script, "serve"] if script else [sys.executable, "-m", "loraserve.cli", "serve"]


def children(pid: int) -> list[int]:
    """Direct children of pid, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: split after the last ')'.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    result, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        result += kids
        todo += kids
    return result


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


class ServerProcess:
    """One `loraserve serve` subprocess on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 api_key: str | None = None, new_session: bool = False,
                 cwd: str | None = None, uvicorn_log_level: str = "warning") -> None:
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="loraserve-test-", suffix=".log",
                                               delete=False)
        full_env = dict(os.environ)
        full_env.update({"LORASERVE_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"})
        full_env.update(env or {})
        cmd = serve_command() + args + [
            "--host", "127.0.0.1", "--port", str(self.port), "--uvicorn-log-level",
            uvicorn_log_level,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(
            cmd, env=full_env, stdout=self.log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=new_session, cwd=cwd,
        )
        self._all_pids: set[int] = set()
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self._all_pids = {self.proc.pid, *descendants(self.proc.pid)}
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.output()}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers, timeout=30, **kwargs)

    def post(self, path: str, json: dict, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=json, headers=self.headers, timeout=60,
                          **kwargs)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             timeout=120, max_retries=0)

    def engine_pid(self) -> int:
        return self.get("/v1/engine_stats").json()["engine_pid"]

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-6000:]

    def all_gone(self) -> bool:
        return not any(alive(pid) for pid in self._all_pids | {self.proc.pid})

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> float:
        """Send sig to the API server; returns how long until every process was gone."""
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self._wait_all_gone(start, timeout_s)
        return time.monotonic() - start

    def stop_group(self, sig: int, timeout_s: float = 10.0) -> float:
        """Signal the whole process group, as Ctrl-C in a terminal does."""
        start = time.monotonic()
        os.killpg(self.proc.pid, sig)
        self._wait_all_gone(start, timeout_s)
        return time.monotonic() - start

    def _wait_all_gone(self, start: float, timeout_s: float) -> None:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        wait_until(self.all_gone, max(0.0, timeout_s - (time.monotonic() - start)))

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        # A graceful stop, then SIGKILL for whatever did not go.
        self.stop()
        self.kill()

    def kill(self) -> None:
        """Last resort (and test teardown): SIGKILL whatever is left."""
        for pid in [self.proc.pid, *self._all_pids]:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


def unix_socket_paths(pid: int) -> list[str]:
    """Paths that the unix sockets open in process pid were bound to (from
    /proc/net/unix, which keeps a socket's path even after the file is removed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    paths = []
    for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; '@' marks abstract names.
        if len(fields) >= 8 and fields[6] in inodes and not fields[7].startswith("@"):
            paths.append(fields[7])
    return sorted(set(paths))
