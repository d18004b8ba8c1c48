"""The quick start: README's serve command (the built-in SmolLM2 model with the
demo pirate adapter), run on the CPU, answers a chat request through the adapter
(and the base model does not talk like a pirate)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from serve_utils import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
ADAPTER = ROOT / "examples" / "adapters" / "pirate"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def readme_serve_args() -> list[str]:
    """The arguments of `loraserve serve` in README's quick-start command."""
    first_block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    serve = shlex.split(first_block.group(1).split("&&")[-1])
    assert serve[:2] == ["loraserve", "serve"], serve
    return serve[2:]


@pytest.mark.skipif(not (ADAPTER / "adapter_config.json").is_file(),
                    reason="the demo adapter (examples/adapters/pirate) is not built")
def test_quickstart_chat_through_the_demo_adapter():
    # The README's command, run from the repository root.
    with ServerProcess(readme_serve_args(), cwd=str(ROOT)) as server:
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
