"""The resolver registry with vLLM's contract: register/get/list, plugins in either
form (a factory that returns a resolver, or vLLM's function that registers its
own), selection by name, and a vLLM-style plugin installed as a real entry point
that a running server uses for a name it does not know, beside `org/name` names
found by the filesystem resolver."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import vllm_style_resolver_plugin as plugin
from serve_utils import ServerProcess
from utils import hf_greedy

from loraserve.lora import resolver as resolver_mod
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import (
    LoRAResolver,
    LoRAResolverRegistry,
    LoRAResolverRegistryType,
    load_resolvers,
)
from loraserve.lora.resolvers import filesystem, hf_hub

GROUP = resolver_mod.ENTRY_POINT_GROUP
TESTS_DIR = Path(__file__).parent
PLUGIN_ENTRY_POINT = f"{plugin.__name__}:{plugin.register_alias_resolver.__name__}"


class FixedResolver(LoRAResolver):
    def __init__(self, path: str) -> None:
        self.path = path

    async def resolve_lora(self, base_model_name, lora_name):
        return LoRARequest(lora_name, 1, self.path, base_model_name=base_model_name)


def make_fixed() -> FixedResolver:
    return FixedResolver("/fixed")


def make_broken():
    raise RuntimeError("plugin bug")


def resolve(resolver: LoRAResolver, name: str) -> LoRARequest | None:
    return asyncio.run(resolver.resolve_lora("base", name))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """An empty process registry, no plugin selection, the built-in resolvers off."""
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    for name in (resolver_mod.ENV_PLUGINS, filesystem.ENV_CACHE_DIR, hf_hub.ENV_REPO_LIST,
                 plugin.ALIASES_ENV):
        monkeypatch.delenv(name, raising=False)


def use_entry_points(monkeypatch, *plugins: tuple[str, str]) -> None:
    eps = [EntryPoint(name, value, GROUP) for name, value in plugins]
    monkeypatch.setattr(resolver_mod, "entry_points", lambda group: eps)


def install_plugin_distribution(root: Path) -> Path:
    """A distribution on disk whose metadata declares the alias plugin under our
    entry-point group, as `pip install` of a plugin package leaves it."""
    info = root / "alias_resolver_plugin-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: alias-resolver-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nalias = {PLUGIN_ENTRY_POINT}\n")
    return root


# ---- the registry ---------------------------------------------------------------


def test_registry_registers_gets_and_lists(caplog):
    registry = LoRAResolverRegistryType()
    assert list(registry.get_supported_resolvers()) == []
    one, two, again = FixedResolver("/1"), FixedResolver("/2"), FixedResolver("/3")
    registry.register_resolver("one", one)
    registry.register_resolver("two", two)
    assert list(registry.get_supported_resolvers()) == ["one", "two"]
    assert "one" in registry.get_supported_resolvers()
    assert registry.get_resolver("one") is one and registry.get_resolver("two") is two
    with caplog.at_level(logging.WARNING, logger=resolver_mod.__name__):
        registry.register_resolver("one", again)
    assert registry.get_resolver("one") is again
    assert "registered again" in caplog.text
    with pytest.raises(KeyError, match=r"'nope' is not registered; registered: \['one', 'two'\]"):
        registry.get_resolver("nope")
    with pytest.raises(TypeError, match="must be a LoRAResolver"):
        registry.register_resolver("bad", object())


def test_the_process_registry_is_shared_with_plugins():
    # vLLM plugins import the registry object itself: it must be the one in use.
    assert plugin.LoRAResolverRegistry is resolver_mod.LoRAResolverRegistry
    assert isinstance(LoRAResolverRegistry, LoRAResolverRegistryType)


# ---- plugins --------------------------------------------------------------------


def test_a_vllm_style_plugin_is_found_through_its_installed_entry_point(
    monkeypatch, tmp_path, llama_adapters
):
    monkeypatch.syspath_prepend(str(install_plugin_distribution(tmp_path / "site")))
    monkeypatch.setenv(plugin.ALIASES_ENV, json.dumps({"nick": llama_adapters["r8"]}))
    resolvers = load_resolvers()
    assert [type(r) for r in resolvers] == [plugin.AliasResolver]
    assert list(LoRAResolverRegistry.get_supported_resolvers()) == [plugin.RESOLVER_NAME]
    found = resolve(resolvers[0], "nick")
    assert found.lora_name == "nick" and found.lora_path == llama_adapters["r8"]
    assert resolve(resolvers[0], "other") is None


def test_an_unconfigured_vllm_style_plugin_registers_nothing(monkeypatch):
    use_entry_points(monkeypatch, ("alias", PLUGIN_ENTRY_POINT))
    assert load_resolvers() == []


def test_both_plugin_forms_are_asked_in_order(monkeypatch, tmp_path):
    use_entry_points(monkeypatch, ("zz_alias", PLUGIN_ENTRY_POINT),
                     ("aa_fixed", f"{__name__}:make_fixed"),
                     ("mm_broken", f"{__name__}:make_broken"))
    monkeypatch.setenv(plugin.ALIASES_ENV, json.dumps({"x": "/x"}))
    monkeypatch.setenv(filesystem.ENV_CACHE_DIR, str(tmp_path))
    resolvers = load_resolvers()
    # Built-ins first, then by entry-point name; the broken one is skipped.
    assert [type(r) for r in resolvers] == [
        filesystem.FilesystemResolver, FixedResolver, plugin.AliasResolver,
    ]
    # A factory's resolver goes by its entry point's name, a vLLM plugin's by its own.
    assert list(LoRAResolverRegistry.get_supported_resolvers()) == [
        "lora_filesystem_resolver", "aa_fixed", plugin.RESOLVER_NAME,
    ]


def test_resolvers_registered_in_code_are_asked_too(monkeypatch):
    use_entry_points(monkeypatch, ("fixed", f"{__name__}:make_fixed"))
    mine = FixedResolver("/mine")
    LoRAResolverRegistry.register_resolver("mine", mine)
    resolvers = load_resolvers()
    assert resolvers[0] is mine and [type(r) for r in resolvers] == [FixedResolver] * 2


def test_plugins_are_chosen_by_name(monkeypatch, tmp_path):
    use_entry_points(monkeypatch, ("fixed", f"{__name__}:make_fixed"),
                     ("alias", PLUGIN_ENTRY_POINT))
    monkeypatch.setenv(plugin.ALIASES_ENV, json.dumps({"x": "/x"}))
    monkeypatch.setenv(filesystem.ENV_CACHE_DIR, str(tmp_path))
    # The order given is the order asked.
    assert [type(r) for r in load_resolvers(["alias", "fixed"])] == [
        plugin.AliasResolver, FixedResolver,
    ]
    monkeypatch.setenv(resolver_mod.ENV_PLUGINS, "lora_filesystem_resolver, fixed")
    assert [type(r) for r in load_resolvers()] == [filesystem.FilesystemResolver,
                                                   FixedResolver]
    # Names given in code win over the environment.
    assert [type(r) for r in load_resolvers(["alias"])] == [plugin.AliasResolver]
    monkeypatch.setenv(resolver_mod.ENV_PLUGINS, "")
    assert load_resolvers() == []


def test_a_chosen_plugin_must_exist_and_load(monkeypatch):
    use_entry_points(monkeypatch, ("fixed", f"{__name__}:make_fixed"),
                     ("broken", f"{__name__}:make_broken"))
    with pytest.raises(ValueError, match=r"unknown LoRA resolver plugin\(s\) \['nope'\]; "
                                         r"installed: \[.*'fixed'.*\]"):
        load_resolvers(["fixed", "nope"])
    with pytest.raises(ValueError, match="'broken' failed to load: RuntimeError: plugin bug"):
        load_resolvers(["broken"])


# ---- a running server -------------------------------------------------------------

PROMPT_IDS_TEXT = "The quick brown fox"
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def resolver_server(tmp_path_factory, llama_dir, llama_adapters):
    root = tmp_path_factory.mktemp("resolver_registry")
    site = install_plugin_distribution(root / "site")
    cache = root / "cache"
    shutil.copytree(llama_adapters["r1"], cache / "org" / "tiny-r1")
    path = os.pathsep.join(p for p in (str(site), str(TESTS_DIR),
                                       os.environ.get("PYTHONPATH")) if p)
    with ServerProcess(
        [llama_dir, "--enable-lora", "--max-loras", "2", "--served-model-name", "base"],
        env={
            "PYTHONPATH": path,
            "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1",
            plugin.ALIASES_ENV: json.dumps({"nickname": llama_adapters["r8"]}),
            filesystem.ENV_CACHE_DIR: str(cache),
        },
    ) as srv:
        yield srv


def greedy_ids(server: ServerProcess, model: str):
    response = server.post("/v1/completions", {
        "model": model, "prompt": PROMPT_IDS_TEXT, "max_tokens": MAX_TOKENS,
        "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
        "return_tokens_as_token_ids": True,
    })
    if response.status_code != 200:
        return response
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_a_server_serves_names_that_the_plugins_resolve(resolver_server, llama_dir,
                                                        llama_adapters):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPT_IDS_TEXT).input_ids
    assert "nickname" not in {m["id"] for m in resolver_server.get("/v1/models").json()["data"]}
    # The vLLM-style plugin's name, and an org/name under the filesystem cache.
    assert greedy_ids(resolver_server, "nickname") == hf_greedy(
        llama_dir, llama_adapters["r8"], ids, MAX_TOKENS), resolver_server.output()
    assert greedy_ids(resolver_server, "org/tiny-r1") == hf_greedy(
        llama_dir, llama_adapters["r1"], ids, MAX_TOKENS), resolver_server.output()
    models = {m["id"]: m for m in resolver_server.get("/v1/models").json()["data"]}
    assert models["nickname"]["root"] == llama_adapters["r8"]
    assert models["nickname"]["parent"] == "base"
    assert "org/tiny-r1" in models
    missing = greedy_ids(resolver_server, "org/missing")
    assert missing.status_code == 404
    assert "`org/missing` does not exist" in missing.json()["error"]["message"]
