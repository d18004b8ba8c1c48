"""The API server's options: `loraserve serve`'s server flags (generated from these
fields, see loraserve/options.py) and what ServerSettings takes from them."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraserve import envs
from loraserve.entrypoints.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES
from loraserve.entrypoints.serving_models import LoRAModulePath
from loraserve.entrypoints.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from loraserve.lora.request import lora_name_error
from loraserve.metrics import METRICS_PREFIXES
from loraserve.options import OptionError, option, positive_int, seconds, string_list

if TYPE_CHECKING:
    from loraserve.config import EngineArgs


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or JSON {"name", "path", "base_model_name"?, "pinned"?}."""
    text = text.strip()
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON in --lora-modules: {exc}") from exc
        if not isinstance(data, dict) or not data.get("name") or not data.get("path"):
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON needs non-empty 'name' and 'path': {text}"
            )
        unknown = set(data) - {"name", "path", "base_model_name", "pinned"}
        if unknown:
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON has unknown keys {sorted(unknown)}: {text}"
            )
        return LoRAModulePath(
            name=str(data["name"]),
            path=str(data["path"]),
            base_model_name=data.get("base_model_name"),
            pinned=bool(data.get("pinned", False)),
        )
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(
            f"--lora-modules expects name=path or a JSON object, got {text!r}"
        )
    return LoRAModulePath(name=name.strip(), path=path.strip())


@dataclass
class CORSPolicy:
    """Starlette's CORSMiddleware settings; any origin by default, as in vLLM."""

    allow_origins: list[str] = field(default_factory=lambda: ["*"])
    allow_methods: list[str] = field(default_factory=lambda: ["*"])
    allow_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


def _server(default: object = None, **meta: object) -> object:
    return option(default, group="Server", **meta)


def _cors_list(what: str) -> object:
    return _server(type=string_list, metavar="LIST", help=f"CORS: {what} (default: any).")


def _or_any(values: list[str] | None) -> list[str]:
    return ["*"] if values is None else values


@dataclass(kw_only=True)
class ServerArgs:
    """What the API server is asked for on the command line. The flags' values
    as they are; ServerSettings adds what is known once the engine's config is.
    check() refuses combinations that cannot work, before anything loads."""

    host: str | None = _server(help="Host to bind (default: all interfaces).")
    port: int = _server(8000, help="Port to listen on.")
    api_key: str | None = _server(
        help=f"Require 'Authorization: Bearer KEY' on every endpoint but /health, /version "
        f"and /metrics (also from ${envs.API_KEY.name}, or vLLM's ${envs.API_KEY.aliases[0]}).")
    metrics_require_api_key: bool = _server(
        False, help="With --api-key, require the key on /metrics too (the Prometheus scraper "
        "then needs it).")
    metrics_prefix: str = _server(
        "loraserve", choices=list(METRICS_PREFIXES),
        help="The prefix of the /metrics names: 'loraserve' (loraserve:num_requests_running, "
        "...) or 'vllm' (vllm:num_requests_running, ...: vLLM's names, for routers and "
        "dashboards set up for vLLM). Only the names change.")
    served_model_name: list[str] | None = _server(
        nargs="+", help="Name(s) the base model answers to in the API (default: MODEL).")
    chat_template: str | None = _server(
        help="A Jinja chat template file that replaces the tokenizer's own.")
    trust_request_chat_template: bool = _server(
        False, help="Accept a chat template in the request (chat_template, or chat_template in "
        "chat_template_kwargs). A template is code that runs in the server: refused by "
        "default.")
    max_request_body_bytes: int = _server(DEFAULT_MAX_REQUEST_BODY_BYTES, type=positive_int,
                                          help="Larger request bodies get 413.")
    shutdown_timeout: float = _server(
        DEFAULT_SHUTDOWN_TIMEOUT_S, type=seconds, metavar="SECONDS",
        help="On SIGTERM or SIGINT, stop taking requests and let those in flight finish for "
        "up to this long; then answer what still runs with 503 (a stream with an error event "
        "and [DONE]). 0: answer them at once.")
    generation_config: str = _server(
        "auto", help="Where unset sampling fields take their defaults from: 'auto' (the "
        "model's generation_config.json), 'vllm' (OpenAI's defaults only) or a folder holding "
        "a generation_config.json.")
    uvicorn_log_level: str = _server(
        "info", choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn.")
    disable_uvicorn_access_log: bool = _server(
        False, help="Leave out uvicorn's log line for each HTTP request.")
    response_role: str = _server(
        "assistant",
        help="The role of chat answers to a generation prompt (add_generation_prompt).")
    enable_log_requests: bool = _server(
        False, exclusive="log_requests",
        help="Log one line per request: its id, model, prompt length and sampling "
        "parameters (never the prompt's text). Off by default.")
    disable_log_requests: bool = _server(
        False, exclusive="log_requests",
        help="Accepted for compatibility with vLLM; requests are not logged unless "
        "--enable-log-requests is given, so it changes nothing.")
    allowed_origins: list[str] | None = _server(
        type=string_list, metavar="LIST",
        help='CORS: origins allowed, as a JSON list (\'["https://a.example"]\') or '
        "comma-separated (default: any, \"*\").")
    allowed_methods: list[str] | None = _cors_list("HTTP methods allowed")
    allowed_headers: list[str] | None = _cors_list("request headers allowed")
    allow_credentials: bool = _server(
        False, help="CORS: allow credentials (cookies, Authorization) in cross-origin requests.")
    root_path: str | None = _server(
        help="The path prefix a reverse proxy serves the API under (FastAPI's root_path), "
        "e.g. /loraserve; the routes themselves stay where they are.")
    ssl_keyfile: str | None = _server(help="Serve HTTPS with this key file.")
    ssl_certfile: str | None = _server(help="Serve HTTPS with this certificate file.")
    ssl_ca_certs: str | None = _server(
        help="CA certificates to check client certificates with.")
    ssl_cert_reqs: int = _server(
        0, choices=[0, 1, 2], help="Client certificates: 0 not asked for, 1 optional, 2 "
        "required (Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED).")
    enable_auto_tool_choice: bool = _server(
        False, help='Let chat requests use tool_choice "auto" (the default when tools are '
        "given): the model decides, and its tool calls are read out of its text with "
        "--tool-call-parser. Without it such requests get 400, as in vLLM; \"required\" and "
        "a named function work either way.")
    tool_call_parser: str | None = _server(
        metavar="NAME", help="How the model writes tool calls: hermes, llama3_json, mistral, "
        "pythonic, or a name a --tool-parser-plugin registers.")
    tool_parser_plugin: str | None = _server(
        metavar="PATH", help="A Python file that registers more tool parsers "
        "(ToolParserManager.register_module), as a vLLM tool-parser plugin does.")

    lora_modules: list[LoRAModulePath] | None = option(
        None, group="LoRA", needs_lora=True, nargs="+", type=parse_lora_module,
        metavar="NAME=PATH|JSON",
        help="Adapters to load at start-up: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ..., "pinned": true}\'.')
    # None: $LORASERVE_PLUGINS (or $VLLM_PLUGINS), else all installed.
    lora_resolvers: list[str] | None = option(
        None, group="LoRA", needs_lora=True, nargs="+", metavar="NAME",
        help="LoRA resolver plugins to run (entry points of loraserve.lora_resolvers), in the "
        "order they are asked; default: $LORASERVE_PLUGINS (or $VLLM_PLUGINS), else all "
        "installed. Needs LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=1 (or "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).")

    @property
    def cors(self) -> CORSPolicy:
        return CORSPolicy(allow_origins=_or_any(self.allowed_origins),
                          allow_methods=_or_any(self.allowed_methods),
                          allow_headers=_or_any(self.allowed_headers),
                          allow_credentials=self.allow_credentials)

    def check(self, engine: EngineArgs) -> None:
        """Refuse what cannot work, given the engine's options (checked already)."""
        if not 0 < self.port < 65536:
            raise OptionError("{port} must be in 1..65535, got {value}", value=self.port)
        if self.root_path and not self.root_path.startswith("/"):
            raise OptionError("{root_path} must start with '/', got {value!r}",
                              value=self.root_path)
        modules = self.lora_modules or []
        names = [m.name for m in modules]
        for name in names:
            reason = lora_name_error(name)
            if reason is not None:
                raise OptionError("{lora_modules}: {reason}", reason=reason)
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise OptionError("{lora_modules} names must be unique; repeated: {value}",
                              value=duplicates)
        clash = sorted(set(names) & set(self.served_model_name or [engine.model]))
        if clash:
            raise OptionError("adapter names {value} clash with the served model name",
                              value=clash)
        if engine.max_loras != "auto":  # else decided, and checked, at start-up
            check_pinned(modules, engine.max_loras)
        self._check_tool_parser()

    def _check_tool_parser(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise OptionError("{enable_auto_tool_choice} needs {tool_call_parser}")
        from loraserve.entrypoints.tool_parsers.base import ToolParserManager, load_tool_parser

        if self.tool_parser_plugin:
            try:
                ToolParserManager.import_tool_parser(self.tool_parser_plugin)
            except ValueError as exc:
                raise OptionError("{tool_parser_plugin}: {error}", error=exc) from exc
        if self.tool_call_parser:
            try:
                load_tool_parser(self.tool_call_parser)
            except ValueError as exc:
                raise OptionError("{tool_call_parser}: {error}", error=exc) from exc


def check_pinned(modules: list[LoRAModulePath], max_loras: int) -> None:
    """Pinned adapters must fit the slots, and leave one to every other adapter
    that could be asked for."""
    pinned = sum(m.pinned for m in modules)
    if pinned > max_loras:
        raise OptionError("{pinned} pinned adapters do not fit in {max_loras} {value}",
                          pinned=pinned, value=max_loras)
    if pinned < max_loras:
        return
    # Pinned adapters never give up their slots: every other adapter would wait
    # for a slot for ever. Only safe when no other adapter can ever be asked for.
    others = [what for what, present in (
        ("the unpinned {lora_modules}", pinned < len(modules)),
        ("adapters loaded at run time or found by resolvers "
         f"({envs.ALLOW_RUNTIME_LORA_UPDATING.name})",
         envs.ALLOW_RUNTIME_LORA_UPDATING.flag()),
    ) if present]
    if others:
        raise OptionError(
            "{pinned} pinned adapters hold all {max_loras} {value} device slots for good, "
            f"leaving none for {' or '.join(others)}: pin fewer adapters or raise "
            "{max_loras}", pinned=pinned, value=max_loras)
