"""LoRA resolvers: discovery through the `loraserve.lora_resolvers` entry points,
the filesystem resolver and the Hugging Face Hub resolver (with the download
replaced, so no network is needed)."""

from __future__ import annotations

import asyncio
import json
from importlib.metadata import EntryPoint

import pytest

from loraserve.lora import resolver as resolver_mod
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolver, LoRAResolverRegistry, load_resolvers
from loraserve.lora.resolvers import filesystem, hf_hub


@pytest.fixture(autouse=True)
def empty_registry(monkeypatch):
    """Plugins register into the process's registry: each test starts with it empty."""
    monkeypatch.setattr(LoRAResolverRegistry, "resolvers", {})
    monkeypatch.delenv(resolver_mod.ENV_PLUGINS, raising=False)


def make_adapter_dir(path, peft_type="LORA"):
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": peft_type, "r": 8}))
    return path


def resolve(resolver, name):
    return asyncio.run(resolver.resolve_lora("base", name))


def test_filesystem_resolver(tmp_path):
    make_adapter_dir(tmp_path / "sql")
    make_adapter_dir(tmp_path / "prefix", peft_type="PREFIX_TUNING")
    (tmp_path / "empty").mkdir()
    fs = filesystem.FilesystemResolver(tmp_path)
    found = resolve(fs, "sql")
    assert isinstance(found, LoRARequest)
    assert found.lora_name == "sql" and found.lora_path == str((tmp_path / "sql").resolve())
    assert found.base_model_name == "base"
    for name in ["missing", "prefix", "empty", "../sql", "sql/..", "/etc"]:
        assert resolve(fs, name) is None, name


def test_filesystem_resolver_finds_org_slash_name(tmp_path):
    cache = tmp_path / "cache"
    make_adapter_dir(cache / "org" / "sql")
    make_adapter_dir(cache / "flat")
    outside = make_adapter_dir(tmp_path / "outside")
    (cache / "org" / "link").symlink_to(outside)
    fs = filesystem.FilesystemResolver(cache)
    found = resolve(fs, "org/sql")
    assert found.lora_name == "org/sql"
    assert found.lora_path == str((cache / "org" / "sql").resolve())
    # "org" holds adapters but is none; the other names reach outside the cache or
    # give one adapter a second name.
    for name in ["org", "org/", "org//sql", "org/./sql", "org/../flat", "org/sql/..",
                 "org/link", "org/missing", "/org/sql"]:
        assert resolve(fs, name) is None, name


def test_filesystem_resolver_needs_its_env(monkeypatch, tmp_path):
    monkeypatch.delenv(filesystem.ENV_CACHE_DIR, raising=False)
    assert filesystem.create_resolver() is None
    monkeypatch.setenv(filesystem.ENV_CACHE_DIR, str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not a directory"):
        filesystem.create_resolver()
    monkeypatch.setenv(filesystem.ENV_CACHE_DIR, str(tmp_path))
    assert isinstance(filesystem.create_resolver(), filesystem.FilesystemResolver)


def test_hf_hub_resolver_only_downloads_allowed_repos(monkeypatch, tmp_path):
    calls = []

    def fake_download(repo_id, subfolder):
        calls.append((repo_id, subfolder))
        root = tmp_path / repo_id.replace("/", "--")
        if not root.exists():
            make_adapter_dir(root)
            make_adapter_dir(root / "sub")
        return str(root)

    monkeypatch.setattr(hf_hub, "_download", fake_download)
    monkeypatch.setenv(hf_hub.ENV_REPO_LIST, "org/adapters, org/other")
    hub = hf_hub.create_resolver()
    assert hub.repos == ["org/adapters", "org/other"]
    root = resolve(hub, "org/adapters")
    assert root.lora_path == str(tmp_path / "org--adapters")
    sub = resolve(hub, "org/adapters/sub")
    assert sub.lora_path == str(tmp_path / "org--adapters" / "sub")
    assert resolve(hub, "org/adapters/missing") is None
    assert resolve(hub, "evil/repo") is None
    assert resolve(hub, "org/adapters/../x") is None
    assert ("evil/repo", "") not in calls
    assert all(repo in hub.repos for repo, _ in calls)


def test_hf_hub_resolver_treats_download_errors_as_not_found(monkeypatch):
    def broken(repo_id, subfolder):
        raise OSError("no network")

    monkeypatch.setattr(hf_hub, "_download", broken)
    assert resolve(hf_hub.HFHubResolver(["org/a"]), "org/a") is None


def test_hf_hub_resolver_needs_its_env(monkeypatch):
    monkeypatch.delenv(hf_hub.ENV_REPO_LIST, raising=False)
    assert hf_hub.create_resolver() is None


class EchoResolver(LoRAResolver):
    async def resolve_lora(self, base_model_name, lora_name):
        return LoRARequest(lora_name, 1, f"/echo/{lora_name}")


def make_echo() -> EchoResolver:
    return EchoResolver()


def make_nothing() -> None:
    return None


def make_broken():
    raise RuntimeError("plugin bug")


def test_plugins_are_discovered_in_order(monkeypatch, tmp_path):
    group = resolver_mod.ENTRY_POINT_GROUP
    plugins = [
        EntryPoint("zz_echo", f"{__name__}:make_echo", group),
        EntryPoint("aa_unconfigured", f"{__name__}:make_nothing", group),
        EntryPoint("mm_broken", f"{__name__}:make_broken", group),
    ]
    monkeypatch.setattr(resolver_mod, "entry_points", lambda group: plugins)
    monkeypatch.setenv(filesystem.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(hf_hub.ENV_REPO_LIST, raising=False)
    resolvers = load_resolvers()
    # The built-in filesystem resolver first; unconfigured and broken ones skipped.
    assert [type(r) for r in resolvers] == [filesystem.FilesystemResolver, EchoResolver]
    assert resolve(resolvers[1], "x").lora_path == "/echo/x"
