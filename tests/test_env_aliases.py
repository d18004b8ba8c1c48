"""vLLM's environment variables for the settings loraserve shares are read beside
ours, so that a manifest written for `vllm serve` works unchanged: each alias
alone sets the value, ours wins when both are set, VLLM_PLUGINS skips vLLM's
plugins of other kinds, and a real server started with vLLM's variables only
requires vLLM's API key, loads adapters at run time and resolves them from vLLM's
cache folder. docs/configuration.md names every alias."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from serve_utils import ServerProcess

from loraserve import envs
from loraserve.lora.resolver import LoRAResolverRegistry, load_resolvers
from loraserve.lora.resolvers import filesystem, hf_hub

ROOT = Path(__file__).resolve().parent.parent
# Ours -> vLLM's name for the same setting.
EXPECTED_ALIASES = {
    "LORASERVE_API_KEY": "VLLM_API_KEY",
    "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "LORASERVE_PLUGINS": "VLLM_PLUGINS",
    "LORASERVE_LORA_RESOLVER_CACHE_DIR": "VLLM_LORA_RESOLVER_CACHE_DIR",
    "LORASERVE_LORA_RESOLVER_HF_REPO_LIST": "VLLM_LORA_RESOLVER_HF_REPO_LIST",
    "LORASERVE_KEEP_ALIVE_ON_ENGINE_DEATH": "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH",
    "LORASERVE_ENGINE_READY_TIMEOUT_S": "VLLM_ENGINE_READY_TIMEOUT_S",
}
ALIASED = [var for var in envs.VARIABLES if var.aliases]


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No variable of ours or vLLM's set, and an empty resolver registry."""
    for var in envs.VARIABLES:
        for name in (var.name, *var.aliases):
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})


def test_the_shared_settings_have_vllms_names():
    assert {var.name: var.aliases for var in ALIASED} == {
        ours: (theirs,) for ours, theirs in EXPECTED_ALIASES.items()}


@pytest.mark.parametrize("var", ALIASED, ids=lambda var: var.name)
def test_an_alias_alone_sets_the_value_and_ours_wins(monkeypatch, var):
    (alias,) = var.aliases
    assert var.get() == var.default and var.raw() is None and var.source() == var.name
    monkeypatch.setenv(alias, "7")
    assert (var.get(), var.raw(), var.source()) == ("7", "7", alias)
    monkeypatch.setenv(var.name, "8")
    assert (var.get(), var.raw(), var.source()) == ("8", "8", var.name)
    # Ours set but empty: unset for a value (the alias's counts), but an empty list
    # where empty means something (raw).
    monkeypatch.setenv(var.name, "")
    assert var.get() == "7" and var.raw() == "" and var.source() == var.name


def test_vllm_switch_values_turn_flags_on(monkeypatch):
    for value in ("1", "true", "True"):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert envs.ALLOW_RUNTIME_LORA_UPDATING.flag()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not envs.ALLOW_RUNTIME_LORA_UPDATING.flag()
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert envs.ALLOW_RUNTIME_LORA_UPDATING.flag()


def test_vllm_plugins_picks_resolvers_and_skips_vllms_other_plugins(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("VLLM_PLUGINS", "some_platform_plugin,lora_filesystem_resolver")
    (only,) = load_resolvers()
    assert isinstance(only, filesystem.FilesystemResolver)
    assert only.cache_dir == tmp_path.resolve()
    monkeypatch.setenv("VLLM_PLUGINS", "")
    assert load_resolvers() == []
    # Ours wins, and names in ours must exist.
    monkeypatch.setenv("VLLM_PLUGINS", "lora_filesystem_resolver")
    monkeypatch.setenv("LORASERVE_PLUGINS", "")
    assert load_resolvers() == []
    monkeypatch.setenv("LORASERVE_PLUGINS", "some_platform_plugin")
    with pytest.raises(ValueError, match="unknown LoRA resolver plugin"):
        load_resolvers()


def test_resolver_folders_and_repos_come_from_vllms_names(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_LORA_RESOLVER_HF_REPO_LIST", "org/a, org/b")
    assert hf_hub.create_resolver().repos == ["org/a", "org/b"]
    missing = tmp_path / "missing"
    monkeypatch.setenv("VLLM_LORA_RESOLVER_CACHE_DIR", str(missing))
    # A bad folder is named by the variable that gave it.
    with pytest.raises(ValueError, match="VLLM_LORA_RESOLVER_CACHE_DIR=.*missing"):
        filesystem.create_resolver()
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_CACHE_DIR", str(tmp_path))
    assert filesystem.create_resolver().cache_dir == tmp_path.resolve()


def test_the_docs_name_every_alias_beside_ours():
    section = (ROOT / "docs" / "configuration.md").read_text().split(
        "## Environment variables", 1)[1]
    rows = {line.split("|")[1]: line for line in section.splitlines() if line.startswith("| `")}
    for ours, theirs in EXPECTED_ALIASES.items():
        (row,) = [line for first, line in rows.items() if f"`{ours}`" in first]
        assert f"`{theirs}`" in row, ours


def test_a_server_configured_with_vllms_variables(tmp_path, llama_dir, llama_adapters):
    cache = tmp_path / "cache"
    shutil.copytree(llama_adapters["r1"], cache / "found")
    env = {
        "VLLM_API_KEY": "vllm-key",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_LORA_RESOLVER_CACHE_DIR": str(cache),
        "VLLM_PLUGINS": "lora_filesystem_resolver",
    }
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
    with ServerProcess([llama_dir, "--served-model-name", "base", "--enable-lora",
                        "--max-loras", "2"], env=env) as server:
        # The key is required (no --api-key given: it comes from VLLM_API_KEY) ...
        assert server.get("/v1/models").status_code == 401
        server.api_key = "vllm-key"
        assert server.get("/v1/models").status_code == 200
        # ... runtime loading is on ...
        loaded = server.post("/v1/load_lora_adapter",
                             {"lora_name": "loaded", "lora_path": llama_adapters["r8"]})
        assert loaded.status_code == 200, loaded.text
        assert server.post("/v1/completions", {"model": "loaded", **body}).status_code == 200
        # ... and the filesystem resolver finds a name in vLLM's cache folder.
        found = server.post("/v1/completions", {"model": "found", **body})
        assert found.status_code == 200, found.text
        assert "found" in [m["id"] for m in server.get("/v1/models").json()["data"]]
