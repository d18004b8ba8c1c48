"""Helpers for the load, fuzz and fault tests: one HTTP call as a `Reply` that
records how it ended (status, body, SSE events, [DONE], transport error),
checks of OpenAI's error shape, and the generated token ids of an answer.

Every call has a timeout, so a hung request shows up as a failed Reply instead
of blocking the suite."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from serve_utils import ServerProcess, wait_until

REQUEST_TIMEOUT_S = 120.0
# Finish reasons of an answer that ran to its end.
COMPLETE_REASONS = {"stop", "length"}
ERROR_KEYS = {"message", "type", "param", "code"}


def start_server(args: list[str], env: dict[str, str] | None = None,
                 **kwargs: Any) -> ServerProcess:
    """`loraserve serve` with the Hub switched off: a path that is not a local
    directory must fail at once, never reach for the network."""
    full_env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    return ServerProcess(args, env=full_env, **kwargs)


@dataclass
class Reply:
    """How one request ended, whatever it was."""

    status: int | None = None
    body: Any = None
    text: str = ""
    stream: bool = False
    events: list[dict] = field(default_factory=list)
    done: bool = False
    # A transport failure (timeout, connection cut) as "ExceptionName: message".
    exception: str | None = None

    @property
    def error_events(self) -> list[dict]:
        return [e for e in self.events if "error" in e]

    def describe(self) -> str:
        tail = self.text[-300:] if self.text else ""
        return (f"status={self.status} exception={self.exception} done={self.done} "
                f"errors={self.error_events} text={tail!r}")


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def call(url: str, path: str, body: Any = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None,
         timeout: float | httpx.Timeout = REQUEST_TIMEOUT_S) -> Reply:
    """POST one request (JSON body, or raw bytes as content) and read it to the end;
    an SSE answer is parsed event by event."""
    reply = Reply(stream=isinstance(body, dict) and bool(body.get("stream")))
    send_headers = {"content-type": "application/json", **(headers or {})}
    kwargs: dict[str, Any] = {"content": content} if content is not None else {"json": body}
    lines: list[str] = []
    try:
        with httpx.stream("POST", url + path, headers=send_headers, timeout=timeout,
                          **kwargs) as response:
            reply.status = response.status_code
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                reply.stream = True
                for line in response.iter_lines():
                    lines.append(line)
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        reply.done = True
                        continue
                    event = _json_or_none(data)
                    reply.events.append(event if isinstance(event, dict) else {"raw": data})
                reply.text = "\n".join(lines)
            else:
                reply.text = response.read().decode("utf-8", errors="replace")
                reply.body = _json_or_none(reply.text)
    except httpx.HTTPError as exc:
        reply.exception = f"{type(exc).__name__}: {exc}"
        reply.text = "\n".join(lines) or reply.text
    return reply


def openai_error_problems(body: Any) -> list[str]:
    """What is wrong with an error body against OpenAI's
    {"error": {"message", "type", "param", "code"}}; empty when it is right."""
    if not isinstance(body, dict) or not isinstance(body.get("error"), dict):
        return [f"no 'error' object in {body!r:.300}"]
    error = body["error"]
    problems = []
    if not ERROR_KEYS <= error.keys():
        problems.append(f"missing {sorted(ERROR_KEYS - error.keys())} in {error!r:.300}")
    if not isinstance(error.get("message"), str) or not error.get("message"):
        problems.append(f"message is not a non-empty string: {error.get('message')!r:.300}")
    if not isinstance(error.get("type"), str) or not error.get("type"):
        problems.append(f"type is not a non-empty string: {error.get('type')!r}")
    if error.get("param") is not None and not isinstance(error.get("param"), str):
        problems.append(f"param is neither a string nor null: {error.get('param')!r}")
    if not isinstance(error.get("code"), int | str | None):
        problems.append(f"code is not an int, string or null: {error.get('code')!r}")
    return problems


def assert_openai_error(body: Any, status: int | None = None) -> dict:
    """The error object of an OpenAI-shaped error body (with that code, if given)."""
    problems = openai_error_problems(body)
    assert not problems, problems
    error = body["error"]
    if status is not None:
        assert error["code"] == status, error
    return error


def assert_complete(reply: Reply) -> None:
    """A 200 answer that ran to its end: for a stream, no error event, [DONE] last
    and a finish reason for every choice."""
    assert reply.exception is None and reply.status == 200, reply.describe()
    if reply.stream:
        assert reply.done and not reply.error_events, reply.describe()
        reasons: dict[int, str | None] = {}
        for event in reply.events:
            for choice in event.get("choices", []):
                if choice.get("finish_reason") is not None:
                    reasons[choice["index"]] = choice["finish_reason"]
        assert reasons and set(reasons.values()) <= COMPLETE_REASONS, reply.describe()
    else:
        choices = reply.body["choices"]
        assert choices, reply.describe()
        assert {c["finish_reason"] for c in choices} <= COMPLETE_REASONS, reply.describe()


def outcome(reply: Reply, error_codes: set[int]) -> str:
    """'complete', or 'error' for an OpenAI-shaped error whose code is one of
    error_codes (a status before any output, or an error event in a stream that
    then ends with [DONE]). Anything else fails: a cut stream, a hang, another
    code, an error body of another shape."""
    assert reply.exception is None, reply.describe()
    if reply.status != 200:
        assert reply.status in error_codes, reply.describe()
        assert_openai_error(reply.body, reply.status)
        return "error"
    if reply.stream and reply.error_events:
        assert reply.done, reply.describe()
        for event in reply.error_events:
            error = assert_openai_error(event)
            assert error["code"] in error_codes, reply.describe()
        return "error"
    assert_complete(reply)
    return "complete"


def completion_body(model: str, prompt: str | list[int], max_tokens: int,
                    stream: bool = False, **extra: Any) -> dict:
    """A greedy completion whose token ids come back in the logprobs."""
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, "logprobs": 0,
            "return_tokens_as_token_ids": True, **extra}


def chat_body(model: str, content: str, max_tokens: int, stream: bool = False,
              **extra: Any) -> dict:
    """A greedy chat completion whose token ids come back in the logprobs."""
    return {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, "logprobs": True, "return_tokens_as_token_ids": True, **extra}


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _choice_tokens(choice: dict, chat: bool) -> list[str]:
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [c["token"] for c in logprobs.get("content") or []]
    return list(logprobs.get("tokens") or [])


def token_ids(reply: Reply) -> dict[int, list[int]]:
    """The generated token ids of each choice of a complete answer (stream or not,
    chat or completion), from the `token_id:N` logprob entries."""
    assert_complete(reply)
    found: dict[int, list[str]] = {}
    if reply.stream:
        for event in reply.events:
            for choice in event.get("choices", []):
                chat = "delta" in choice
                found.setdefault(choice["index"], []).extend(_choice_tokens(choice, chat))
    else:
        chat = reply.body.get("object") == "chat.completion"
        for choice in reply.body["choices"]:
            found[choice["index"]] = _choice_tokens(choice, chat)
    return {index: _ids(tokens) for index, tokens in found.items()}


def engine_stats(server: ServerProcess) -> dict:
    return server.get("/v1/engine_stats").json()


def engine_idle(server: ServerProcess) -> bool:
    """No request running or waiting and no KV block in use."""
    stats = engine_stats(server)["scheduler"]
    return stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
        stats["kv_cache_usage"] == 0.0


def wait_engine_idle(server: ServerProcess, timeout_s: float = 15.0) -> bool:
    return wait_until(lambda: engine_idle(server), timeout_s, 0.1)


def leftover_ipc_dirs(tmp_dir: str | Path) -> list[str]:
    """The engine's socket folders (loraserve-*) still in a server's TMPDIR."""
    return sorted(p for p in os.listdir(tmp_dir) if p.startswith("loraserve-"))
