"""The quick start and the examples, against the real thing: README's serve command
(the built-in SmolLM2 model with the demo pirate adapter), run on the CPU, answers
README's curl request and a chat through the adapter, and every example client in
examples/README.md prints what that page shows (ids, timestamps and timings aside),
so that the documented outputs cannot drift from what the server says."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from serve_utils import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "examples" / "adapters" / "pirate"
EXAMPLES_README = ROOT / "examples" / "README.md"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# The example clients whose outputs examples/README.md shows (train_adapter.py
# trains for minutes and prints timings: it is left out).
CLIENTS = ("openai_chat_completion.py", "openai_completion.py", "curl_examples.sh",
           "load_unload_adapters.sh")
# What differs from run to run, whatever the model says: ids, clocks, the engine's
# pid, load timings, step counts, and the value (an update time) of a metric sample.
_VARYING = [
    (re.compile(r"\b(chatcmpl|cmpl)-[0-9a-f]{32}\b"), r"\1-ID"),
    (re.compile(r'("created": ?)\d+'), r"\1T"),
    (re.compile(r'("engine_pid": ?)\d+'), r"\1PID"),
    (re.compile(r'("lora_load_time_(?:counts|sum_s)": ?)(\[[\d, ]*\]|[\d.e+-]+)'), r"\1X"),
    (re.compile(r'("prefix_cache_tokens": ?)\[[\d, ]*\]'), r"\1X"),
    (re.compile(r'("step_lora_adapter_counts": ?)\[[\d, ]*\]'), r"\1X"),
    (re.compile(r'("step_lora_adapters_sum": ?)\d+'), r"\1X"),
    (re.compile(r'("lora_cache_(?:hits|misses)": ?)\d+'), r"\1X"),
    (re.compile(r"^(loraserve:\w+\{.*\}) \S+$", re.M), r"\1 V"),
]


def _normalized(text: str) -> str:
    for pattern, replacement in _VARYING:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _matches(documented: str, actual: str) -> bool:
    """Whether the output equals the documented one, where a line `...` of the
    documentation stands for any number of lines."""
    pattern = "".join(r"(?:.*\n)*?" if line == "..." else re.escape(line) + "\n"
                      for line in _normalized(documented).split("\n"))
    return re.fullmatch(pattern, _normalized(actual) + "\n") is not None


def readme_serve_args() -> list[str]:
    """The arguments of `loraserve serve` in README's quick-start command."""
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    serve = shlex.split(first_block.group(1).split("&&")[-1])
    assert serve[:2] == ["loraserve", "serve"], serve
    return serve[2:]


def examples_server() -> tuple[dict[str, str], list[str]]:
    """The environment and `loraserve serve` arguments examples/README.md starts
    its server with."""
    block = re.search(r"```bash\n(.*?)```", EXAMPLES_README.read_text(), re.S).group(1)
    words = shlex.split(block)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[:2] == ["loraserve", "serve"], words
    return env, words[2:]


def documented_outputs() -> dict[str, tuple[str, str]]:
    """client file -> (the command its section runs, the output it shows)."""
    found = {}
    for section in re.split(r"(?m)^## ", EXAMPLES_README.read_text())[1:]:
        name = section.split("\n", 1)[0].strip()
        block = re.search(r"```console\n\$ (.*?)\n(.*?)```", section, re.S)
        if name in CLIENTS and block:
            found[name] = (block.group(1), block.group(2))
    return found


def readme_curl() -> list[str]:
    """README's quick-start curl command, as argv."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(),
                                       re.S) if b.lstrip().startswith("curl"))
    return shlex.split(block.replace("\\\n", " "))


needs_adapter = pytest.mark.skipif(not (ADAPTER / "adapter_config.json").is_file(),
                                   reason="the demo adapter (examples/adapters/pirate) is "
                                   "not built")


@pytest.fixture(scope="module")
def server():
    env, args = examples_server()
    assert args == readme_serve_args(), "examples/README.md serves what README.md serves"
    with ServerProcess(args, env=env, cwd=str(ROOT)) as proc:
        yield proc


def test_every_client_has_a_documented_output():
    assert sorted(documented_outputs()) == sorted(CLIENTS)


@needs_adapter
def test_quickstart_chat_through_the_demo_adapter(server):
    client = server.openai()
    assert {m.id for m in client.models.list().data} == {"smollm2-135m-instruct", "pirate"}

    def ask(model: str) -> str:
        reply = client.chat.completions.create(model=model, messages=QUESTION,
                                               max_tokens=32, temperature=0.0)
        return reply.choices[0].message.content

    pirate, base = ask("pirate"), ask("smollm2-135m-instruct")
    assert "arr" in pirate.lower(), pirate
    assert "arr" not in base.lower(), base
    assert "paris" in base.lower(), base


@needs_adapter
def test_readme_curl_is_answered_within_its_max_tokens(server):
    argv = [a.replace("localhost:8000", f"127.0.0.1:{server.port}") for a in readme_curl()]
    body = json.loads(argv[argv.index("-d") + 1])
    assert body.get("max_tokens"), "a sampled chat without max_tokens can run for minutes"
    result = subprocess.run(argv + ["-s", "--max-time", "300"], capture_output=True,
                            text=True, timeout=320)
    reply = json.loads(result.stdout)
    assert reply["model"] == body["model"]
    assert reply["choices"][0]["message"]["content"]
    assert 0 < reply["usage"]["completion_tokens"] <= body["max_tokens"]


@needs_adapter
@pytest.mark.parametrize("client", CLIENTS)
def test_example_prints_what_examples_readme_shows(server, client):
    command, documented = documented_outputs()[client]
    argv = shlex.split(command)
    if argv[0] == "python":
        argv = [sys.executable, *argv[1:], "--base-url", f"{server.url}/v1"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**os.environ, "URL": server.url})
    assert result.returncode == 0, result.stderr
    assert _matches(documented, result.stdout), (
        f"examples/README.md shows for {client}:\n{documented}\nthe server now gives:\n"
        f"{result.stdout}"
    )
