"""`loraserve serve` flags: vLLM's names and defaults, and bad combinations that
fail at once with a clear message (before any model loads)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import time

import pytest
from serve_utils import descendants, free_port, serve_command

from loraserve.cli import main
from loraserve.cli_args import (
    build_parser,
    engine_kwargs_from_args,
    parse_lora_module,
    validate_serve_args,
)
from loraserve.config import SUPPORTED_LORA_RANKS, EngineArgs
from loraserve.entrypoints.ray_options import RayOptions
from loraserve.entrypoints.server_args import ServerArgs
from loraserve.options import flag as flag_of
from loraserve.options import lora_only, options


def parse(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["serve", *argv])
    validate_serve_args(args)
    return args


def test_defaults_match_vllm():
    args = parse("some/model")
    assert args.model == "some/model"
    assert args.port == 8000 and args.host is None
    assert args.max_loras == 1 and args.max_lora_rank == 16 and not args.enable_lora
    assert args.max_cpu_loras is None and args.lora_dtype == "auto"
    assert args.gpu_memory_utilization == 0.9 and args.device == "auto"
    assert args.load_format == "auto" and args.dtype == "auto" and args.seed == 0
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["model"] == "some/model" and kwargs["max_loras"] == 1
    assert "max_num_seqs" not in kwargs  # the engine picks per device


def test_lora_modules_both_forms():
    plain = parse_lora_module("sql=/adapters/sql")
    assert (plain.name, plain.path, plain.pinned) == ("sql", "/adapters/sql", False)
    spec = {"name": "poet", "path": "/a/poet", "base_model_name": "m", "pinned": True}
    parsed = parse_lora_module(json.dumps(spec))
    assert (parsed.name, parsed.path, parsed.base_model_name, parsed.pinned) == (
        "poet", "/a/poet", "m", True)
    args = parse("m", "--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x",
                 json.dumps(spec))
    assert [m.name for m in args.lora_modules] == ["a", "poet"]


@pytest.mark.parametrize("text", ["noequals", "=path", "name=", "{bad json", '{"name": "x"}',
                                  '{"name": "x", "path": "y", "color": 1}'])
def test_bad_lora_module_specs(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)


@pytest.mark.parametrize("argv, message", [
    ([], "MODEL is required"),
    (["m", "--lora-modules", "a=/x"], "--enable-lora"),
    (["m", "--max-cpu-loras", "4"], "--enable-lora"),
    (["m", "--lora-target-modules", "q_proj"], "--enable-lora"),
    (["m", "--max-loras", "2"], "--max-loras needs --enable-lora"),
    (["m", "--max-lora-rank", "8"], "--max-lora-rank needs --enable-lora"),
    (["m", "--lora-dtype", "float32"], "--lora-dtype needs --enable-lora"),
    (["m", "--lora-resolvers", "lora_filesystem_resolver"], "--lora-resolvers needs"),
    (["m", "--enable-lora", "--lora-modules", "a=/x", "a=/y"], "unique"),
    (["m", "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"], "--max-cpu-loras"),
    (["m", "--gpu-memory-utilization", "1.5"], "gpu-memory-utilization"),
    (["m", "--port", "70000"], "--port"),
    (["m", "--enable-lora", "--lora-modules", "m=/x"], "clash"),
    (["m", "--enable-lora", "--lora-modules", f"{'x' * 256}=/x"], "this one has 256 characters"),
    (["m", "--enable-lora", "--lora-modules", "my adapter=/x"], "up to 255 characters"),
    (["m", "--enable-lora", "--lora-modules",
      '{"name": "a", "path": "/x", "pinned": true}', '{"name": "b", "path": "/y", "pinned": true}'],
     "pinned"),
])
def test_invalid_combinations_are_refused(argv, message):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message):
        validate_serve_args(args)


def test_pinned_adapters_may_fill_the_slots_only_when_nothing_else_is_served(monkeypatch):
    monkeypatch.delenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    pins = [json.dumps({"name": n, "path": f"/{n}", "pinned": True}) for n in ("a", "b")]
    full = ["m", "--enable-lora", "--max-loras", "2", "--lora-modules", *pins]
    assert [m.pinned for m in parse(*full).lora_modules] == [True, True]
    with pytest.raises(ValueError, match="leaving none for the unpinned --lora-modules"):
        parse(*full, "c=/c")
    monkeypatch.setenv("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with pytest.raises(ValueError, match="hold all --max-loras 2 device slots for good, "
                       "leaving none for adapters loaded at run time"):
        parse(*full)
    assert parse(*full[:3], "3", *full[4:]).max_loras == 3  # a slot to spare


def run_cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command() + list(argv), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_help_reads_well():
    result = run_cli("--help", timeout=60)
    assert result.returncode == 0
    for flag in ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank",
                 "--max-cpu-loras", "--lora-dtype", "--lora-target-modules", "--host",
                 "--port", "--api-key", "--served-model-name", "--dtype", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--gpu-memory-utilization",
                 "--device", "--enforce-eager", "--seed", "--load-format", "--trust-remote-code",
                 "--revision", "--tokenizer-revision", "--download-dir",
                 "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--enable-log-requests", "--disable-log-requests", "--allowed-origins",
                 "--allowed-methods", "--allowed-headers", "--allow-credentials",
                 "--root-path", "--ssl-keyfile", "--ssl-certfile", "--ssl-ca-certs"]:
        assert flag in result.stdout, flag
    # What a flag accepted for compatibility does, or does not do, is said.
    text = " ".join(result.stdout.split())
    assert "no model code from the repo runs" in text
    assert "so it changes nothing" in text


def test_bad_rank_fails_at_once():
    result = run_cli("m", "--max-lora-rank", "7", timeout=60)
    assert result.returncode == 2 and "--max-lora-rank" in result.stderr


def test_missing_model_fails_with_a_clear_message(tmp_path):
    start = time.monotonic()
    result = run_cli(str(tmp_path / "no-such-model"), "--device", "cpu",
                     "--port", str(free_port()))
    assert result.returncode != 0
    assert "no-such-model" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - start < 120


def test_busy_port_fails_before_the_model_loads(llama_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_cli(llama_dir, "--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 1
    assert "address already in use" in result.stderr.lower()
    assert "engine core ready" not in result.stderr


def test_bad_startup_adapter_stops_everything(llama_dir, tmp_path):
    proc = subprocess.Popen(
        serve_command() + [llama_dir, "--host", "127.0.0.1", "--port", str(free_port()),
                           "--enable-lora", "--lora-modules", f"bad={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "bad" in stderr and "Traceback" not in stderr
    assert descendants(proc.pid) == []


def test_the_engine_process_gets_the_config_the_cli_built(llama_dir):
    """`serve` checks the flags into one EngineConfig and the engine process gets that
    object as it is (spawn pickles it), not keyword arguments to validate again."""
    import inspect
    import pickle

    from loraserve.config import EngineConfig
    from loraserve.engine.core_proc import run_engine_core

    args = parse(str(llama_dir), "--enable-lora", "--max-loras", "2", "--max-num-seqs", "4")
    config = EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
    copy = pickle.loads(pickle.dumps(config))
    assert copy.model_config.model == config.model_config.model
    assert copy.model_config.hf_config.to_dict() == config.model_config.hf_config.to_dict()
    assert copy.lora_config == config.lora_config and copy.lora_config.max_loras == 2
    assert copy.scheduler_config == config.scheduler_config
    assert copy.device == config.device and copy.model_config.dtype == config.model_config.dtype
    first = next(iter(inspect.signature(run_engine_core).parameters.values()))
    assert first.annotation in (EngineConfig, "EngineConfig")


# ---- flags vLLM users pass out of habit ------------------------------------------------


def test_vllm_habit_flags_reach_the_engine_and_server(tmp_path):
    args = parse("org/repo", "--trust-remote-code", "--revision", "v1", "--tokenizer-revision",
                 "v2", "--download-dir", str(tmp_path), "--no-enable-prefix-caching",
                 "--disable-log-requests", "--allowed-origins", '["https://a.example"]',
                 "--allowed-methods", "GET,POST", "--allow-credentials", "--root-path", "/x")
    kwargs = engine_kwargs_from_args(args)
    assert kwargs["trust_remote_code"] is True and kwargs["enable_prefix_caching"] is False
    assert (kwargs["revision"], kwargs["tokenizer_revision"]) == ("v1", "v2")
    assert kwargs["download_dir"] == str(tmp_path)
    assert args.allowed_origins == ["https://a.example"]
    assert args.allowed_methods == ["GET", "POST"] and args.allowed_headers is None
    assert args.allow_credentials and args.root_path == "/x" and not args.enable_log_requests
    # Unset, prefix caching keeps the engine's default (on).
    assert "enable_prefix_caching" not in engine_kwargs_from_args(parse("m"))
    assert parse("m", "--enable-prefix-caching").enable_prefix_caching is True


@pytest.mark.parametrize("argv, message", [
    (["m", "--ssl-keyfile", "k.pem"], "go together"),
    (["m", "--ssl-certfile", "c.pem"], "go together"),
    (["m", "--ssl-ca-certs", "ca.pem"], "need --ssl-certfile"),
    (["m", "--root-path", "api"], "--root-path"),
])
def test_invalid_server_flags_are_refused(argv, message):
    args = build_parser().parse_args(["serve", *argv])
    with pytest.raises(ValueError, match=message):
        validate_serve_args(args)


def test_missing_tls_files_and_cert_reqs_without_ca_are_refused(tmp_path):
    key, cert = tmp_path / "k.pem", tmp_path / "c.pem"
    key.write_text("k")
    args = build_parser().parse_args(["serve", "m", "--ssl-keyfile", str(key),
                                      "--ssl-certfile", str(cert)])
    with pytest.raises(ValueError, match="c.pem.*not a file"):
        validate_serve_args(args)
    cert.write_text("c")
    args = build_parser().parse_args(["serve", "m", "--ssl-keyfile", str(key),
                                      "--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"])
    with pytest.raises(ValueError, match="--ssl-ca-certs"):
        validate_serve_args(args)


@pytest.mark.parametrize("text", ["[1, 2]", '["a"', '{"a": 1}'])
def test_bad_cors_lists_are_refused(text, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "m", "--allowed-origins", text])
    assert exc.value.code == 2 and "--allowed-origins" in capsys.readouterr().err


def test_enable_and_disable_log_requests_together_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "m", "--enable-log-requests",
                                   "--disable-log-requests"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_revision_of_a_local_folder_or_builtin_model_is_refused(llama_dir):
    from loraserve.config import EngineConfig

    with pytest.raises(ValueError, match="Hub repo ids only.*local folder"):
        EngineConfig.from_kwargs(llama_dir, revision="main", device="cpu")
    with pytest.raises(ValueError, match="tokenizer_revision.*local folder"):
        EngineConfig.from_kwargs(llama_dir, tokenizer=llama_dir, tokenizer_revision="v1",
                                 device="cpu")
    with pytest.raises(ValueError, match="built-in model"):
        EngineConfig.from_kwargs("smollm2-135m-instruct", revision="main", device="cpu")
    result = run_cli(llama_dir, "--revision", "main", "--device", "cpu", "--port",
                     str(free_port()))
    assert result.returncode == 2
    assert "loraserve serve: error: revision 'main' applies to Hugging Face Hub repo ids " \
        "only" in result.stderr
    assert "Traceback" not in result.stderr


def test_hub_revision_and_download_dir_go_to_the_download(monkeypatch, tmp_path, llama_dir):
    import huggingface_hub

    from loraserve.config import EngineConfig

    calls = []

    def fake_download(repo_id, revision=None, cache_dir=None, **kwargs):
        calls.append((repo_id, revision, cache_dir))
        return llama_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    cache = str(tmp_path / "hub")
    config = EngineConfig.from_kwargs("org/model", revision="abc123", download_dir=cache,
                                      tokenizer="org/tok", tokenizer_revision="v2",
                                      device="cpu")
    assert calls == [("org/model", "abc123", cache), ("org/tok", "v2", cache)]
    assert config.model_config.model == llama_dir
    calls.clear()
    # Without --tokenizer, the tokenizer revision picks another revision of MODEL.
    EngineConfig.from_kwargs("org/model", revision="abc123", tokenizer_revision="v2",
                             device="cpu")
    assert calls == [("org/model", "abc123", None), ("org/model", "v2", None)]


def _remote_code_tokenizer(llama_dir: str, out) -> str:
    """The tiny model's tokenizer as a class of its own, shipped as code in the folder."""
    import shutil
    from pathlib import Path

    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(llama_dir) / name).exists():
            shutil.copy(Path(llama_dir) / name, out / name)
    (out / "tokenization_shipped.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class ShippedTokenizer(PreTrainedTokenizerFast):\n"
        "    shipped = True\n"
    )
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "ShippedTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_shipped.ShippedTokenizer"]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def test_trust_remote_code_loads_a_tokenizer_that_ships_code(llama_dir, tmp_path):
    from loraserve.config import EngineConfig
    from loraserve.engine.tokenizer import load_tokenizer

    folder = _remote_code_tokenizer(llama_dir, tmp_path / "tok")
    refused = EngineConfig.from_kwargs(llama_dir, tokenizer=folder, device="cpu")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_tokenizer(refused)
    config = EngineConfig.from_kwargs(llama_dir, tokenizer=folder, device="cpu",
                                      trust_remote_code=True)
    tokenizer = load_tokenizer(config)
    assert type(tokenizer).__name__ == "ShippedTokenizer" and tokenizer.shipped
    assert tokenizer("Hello world").input_ids


def test_vllm_flags_for_what_loraserve_does_anyway_are_accepted():
    args = parse("m", "--disable-log-stats", "--enable-chunked-prefill", "--swap-space", "4",
                 "--max-log-len", "100", "--kv-cache-dtype", "auto", "-pp", "1", "-dp", "1",
                 "--disable-uvicorn-access-log", "--response-role", "bot")
    assert args.response_role == "bot" and args.disable_uvicorn_access_log


@pytest.mark.parametrize("argv, named", [
    (["--quantization", "awq"], "--quantization awq is not supported"),
    (["-q", "fp8"], "--quantization fp8 is not supported"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 is not supported"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2 is not supported"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2 is not supported"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["--bogus-flag", "3"], "unrecognized arguments: --bogus-flag 3"),
])
def test_vllm_flags_loraserve_lacks_are_refused_by_name_with_serves_usage(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "m", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert named in err
    assert "loraserve serve" in err and "COMMAND" not in err  # not the top level's usage


def test_an_unknown_flag_prints_serves_usage(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "m", "--enable-lora", "--no-such-flag"])
    err = capsys.readouterr().err
    assert err.startswith("usage: loraserve serve ") and "--max-loras" in err
    assert err.rstrip().endswith("unrecognized arguments: --no-such-flag")


def _config_args(tmp_path, text: str, *argv: str) -> argparse.Namespace:
    from loraserve.cli_compat import expand_config_file

    path = tmp_path / "config.yaml"
    path.write_text(text)
    parser = build_parser()
    serve = next(a for a in parser._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    args = parser.parse_args(expand_config_file(["serve", *argv, "--config", str(path)],
                                                serve))
    validate_serve_args(args)
    return args


def test_vllm_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    text = ("model: some/model\nenable-lora: true\nmax_loras: 3\nmax-lora-rank: 32\n"
            "enforce-eager: false\nenable-prefix-caching: false\n"
            "lora-modules:\n  - a=/adapters/a\n  - {name: b, path: /adapters/b}\n")
    args = _config_args(tmp_path, text, "--max-loras", "4")
    assert args.model == "some/model" and args.enable_lora
    assert args.max_loras == 4 and args.max_lora_rank == 32  # the command line wins
    assert args.enable_prefix_caching is False and not args.enforce_eager
    assert [(m.name, m.path) for m in args.lora_modules] == [("a", "/adapters/a"),
                                                              ("b", "/adapters/b")]


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "unknown flag 'no-such-flag'"),
    ("- a\n- b\n", "mapping"),
    ("port: [1\n", "not valid YAML"),
])
def test_bad_config_files_are_refused(tmp_path, text, message):
    from loraserve.cli_compat import CompatError

    with pytest.raises(CompatError, match=message):
        _config_args(tmp_path, text, "m")


# ---- every flag is written once, on an option dataclass's field -------------------------


def _subparser(name: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions
                if isinstance(a, argparse._SubParsersAction)).choices[name]


def _option_classes(command: str) -> list[type]:
    return [EngineArgs, ServerArgs] + ([RayOptions] if command == "serve-ray" else [])


def _compat_dests() -> set[str]:
    from loraserve.cli_compat import add_vllm_compat_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_vllm_compat_arguments(parser)
    return {a.dest for a in parser._actions}


@pytest.mark.parametrize("command", ["serve", "serve-ray"])
def test_every_flag_comes_from_an_option_field(command):
    """The parser's flags are the option fields' (EngineArgs, ServerArgs, RayOptions),
    plus the positional MODEL and vLLM's compatibility flags: none written by hand."""
    fields = {f.name: (f, opt) for cls in _option_classes(command) for f, opt in options(cls)}
    actions = {a.dest: a for a in _subparser(command)._actions
               if not isinstance(a, argparse._HelpAction)}
    assert set(actions) == set(fields) | {"model_tag"} | _compat_dests()
    for name, (f, opt) in fields.items():
        action = actions[name]
        negated = ["--no-" + flag_of(name)[2:]] if f.default is True else []
        assert action.option_strings == [flag_of(name), *opt.aliases, *negated]
        assert action.help == opt.help
        if opt.choices is not None:
            assert list(action.choices) == list(opt.choices)
        # The parser's default is the field's, except where "unset" must be told
        # apart: a LoRA-only flag, and a --x/--no-x pair.
        unset = (opt.needs_lora and f.default is not False or f.default is True
                 or f.default is dataclasses.MISSING)
        assert action.default == (None if unset else f.default), name


def test_lora_ranks_and_the_lora_only_flags_are_the_configs():
    actions = {a.dest: a for a in _subparser("serve")._actions}
    assert tuple(actions["max_lora_rank"].choices) == SUPPORTED_LORA_RANKS
    assert {flag_of(f.name) for cls in _option_classes("serve") for f in lora_only(cls)} == {
        "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--lora-dtype",
        "--lora-resolvers", "--lora-target-modules", "--fully-sharded-loras",
        "--lora-scheduling", "--max-lora-wait-steps"}


def _sample_words(action: argparse.Action) -> list[str]:
    """The flag with a value it accepts."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    if action.choices is not None:
        value = str(next(iter(action.choices)))
    elif action.type is parse_lora_module:
        value = "a=/adapters/a"
    else:
        value = "2"
    return [action.option_strings[0], value]


def _lora_only_actions() -> list[argparse.Action]:
    names = {f.name for cls in _option_classes("serve") for f in lora_only(cls)}
    return [a for a in _subparser("serve")._actions if a.dest in names]


@pytest.mark.parametrize("action", _lora_only_actions(), ids=lambda a: a.option_strings[0])
def test_each_lora_only_flag_is_refused_without_enable_lora(action):
    words = _sample_words(action)
    args = build_parser().parse_args(["serve", "m", *words])
    with pytest.raises(ValueError, match=f"^{action.option_strings[0]} needs --enable-lora$"):
        validate_serve_args(args)
    # With --enable-lora the same flag is taken.
    validate_serve_args(build_parser().parse_args(["serve", "m", "--enable-lora", *words]))


def test_option_checks_name_fields_in_python_and_flags_on_the_command_line():
    """One check, in EngineArgs, before anything loads: the offline API reads the
    keyword argument's name, the command line the flag."""
    with pytest.raises(ValueError, match=r"^max_cpu_loras \(2\) must be at least max_loras \(4\)$"):
        EngineArgs("no/such/model", enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be in \(0, 1\]"):
        EngineArgs("no/such/model", gpu_memory_utilization=0.0)
    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--max-loras", "4",
                                      "--max-cpu-loras", "2"])
    with pytest.raises(ValueError, match=r"^--max-cpu-loras \(2\) must be at least "
                       r"--max-loras \(4\)$"):
        validate_serve_args(args)
