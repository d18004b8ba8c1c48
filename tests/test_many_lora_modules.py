"""Many --lora-modules: the ones the CPU cache holds are read at start-up, the rest
registered (their adapter_config.json checked) and read on first use; every one
is listed and served, and a bad one still stops the start."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from serve_utils import ServerProcess
from transformers import AutoTokenizer
from utils import hf_greedy

NUM_MODULES = 40


@pytest.fixture(scope="module")
def many_adapters(tmp_path_factory, llama_adapters) -> list[Path]:
    """NUM_MODULES adapter folders, every one the files of llama_adapters['r8']."""
    root = tmp_path_factory.mktemp("many")
    source = Path(llama_adapters["r8"])
    folders = []
    for i in range(NUM_MODULES):
        folder = root / f"a{i}"
        folder.mkdir()
        for f in source.iterdir():
            os.link(f, folder / f.name)
        folders.append(folder)
    return folders


def _engine_stats(server: ServerProcess) -> dict:
    return server.get("/v1/engine_stats").json()


def test_many_modules_start_listed_and_each_is_read_on_first_use(llama_dir, llama_adapters,
                                                                 many_adapters, prompts):
    modules = [f"a{i}={folder}" for i, folder in enumerate(many_adapters)]
    with ServerProcess([llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4",
                        "--lora-modules", *modules]) as server:
        cards = {card["id"] for card in server.get("/v1/models").json()["data"]}
        assert {f"a{i}" for i in range(NUM_MODULES)} <= cards
        # Only what the CPU cache holds was read at start-up.
        assert len(_engine_stats(server)["scheduler"]["cpu_lora_adapters"]) <= 4
        tok = AutoTokenizer.from_pretrained(llama_dir)
        want = tok.decode(hf_greedy(llama_dir, llama_adapters["r8"], prompts[1], 4),
                          skip_special_tokens=True)
        for name in ("a0", "a31", "a39"):
            body = server.post("/v1/completions", json={
                "model": name, "prompt": prompts[1], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert body.status_code == 200, body.text
            assert body.json()["choices"][0]["text"] == want, name
        assert "a39" in _engine_stats(server)["scheduler"]["cpu_lora_adapters"]


def test_a_bad_module_among_the_late_ones_stops_the_start(llama_dir, many_adapters, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(many_adapters[0], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 64}))
    modules = [f"a{i}={folder}" for i, folder in enumerate(many_adapters[:6])]
    with pytest.raises(RuntimeError) as failed:
        ServerProcess([llama_dir, "--enable-lora", "--max-loras", "1", "--max-cpu-loras", "2",
                       "--max-lora-rank", "16", "--lora-modules", *modules, f"bad={bad}"])
    assert "--lora-modules bad=" in str(failed.value)
    assert "greater than max_lora_rank" in str(failed.value)
