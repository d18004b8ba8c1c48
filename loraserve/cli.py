"""The `loraserve` command: `loraserve serve MODEL [options]`, with vLLM's flags."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

import loraserve
from loraserve import envs
from loraserve.cli_compat import (
    CompatError,
    add_vllm_compat_arguments,
    check_vllm_compat_args,
    expand_config_file,
)
from loraserve.config import CUDAGRAPH_MODES
from loraserve.entrypoints.middleware import DEFAULT_MAX_REQUEST_BODY_BYTES
from loraserve.entrypoints.serving_models import LoRAModulePath
from loraserve.entrypoints.shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from loraserve.lora.request import lora_name_error
from loraserve.model.builtin import BUILTIN_MODELS

if TYPE_CHECKING:
    from loraserve.entrypoints.api_server import ServerSettings
    from loraserve.ray.app import RayOptions

ALLOWED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoRA flags whose defaults apply only with --enable-lora: left unset by the parser,
# so that giving one without --enable-lora is refused rather than ignored.
_LORA_DEFAULTS = {"max_loras": 1, "max_lora_rank": 16, "lora_dtype": "auto"}


class CLIError(ValueError):
    """A flag or a combination of flags that cannot work; the message says why."""


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


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a default only where it says something (not None/False, not in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def _string_list(text: str) -> list[str]:
    """vLLM's form, a JSON list of strings ('["https://a.example", ...]'), or a
    comma-separated list."""
    text = text.strip()
    if text.startswith(("[", "{")):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON list: {exc}") from exc
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text}")
        return value
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_serve_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="Start the OpenAI-compatible API server.",
        description="Serve a base model and its LoRA adapters over an OpenAI-compatible API.",
        formatter_class=_HelpFormatter,
    )
    _add_serve_arguments(serve)


def _add_serve_ray_parser(subparsers: Any) -> None:
    serve_ray = subparsers.add_parser(
        "serve-ray",
        help="Serve on Ray Serve: one OpenAI-compatible ingress over several engine replicas.",
        description="Serve a base model and its LoRA adapters on Ray Serve: requests for an "
        "adapter go to a replica that already holds it (Ray Serve's model multiplexing).",
        formatter_class=_HelpFormatter,
    )
    _add_serve_arguments(serve_ray)
    ray_group = serve_ray.add_argument_group("Ray Serve")
    ray_group.add_argument(
        "--num-replicas", type=_positive_int, default=1,
        help="Engine replicas to start with (each runs its own engine core).",
    )
    ray_group.add_argument(
        "--max-replicas", type=_positive_int, default=None,
        help="Let Ray Serve's autoscaling add replicas under load, up to this many "
        "(default: a fixed --num-replicas).",
    )
    ray_group.add_argument(
        "--target-ongoing-requests", type=float, default=16.0,
        help="Autoscaling target: requests in flight per replica.",
    )
    ray_group.add_argument(
        "--replica-num-cpus", type=float, default=1.0,
        help="CPUs Ray reserves for each engine replica.",
    )
    ray_group.add_argument(
        "--replica-num-gpus", type=float, default=None,
        help="GPUs Ray reserves for each engine replica (default: 1 with --device cuda "
        "or auto on a GPU machine, else 0).",
    )
    ray_group.add_argument(
        "--ray-address", default=None,
        help="The Ray cluster to join, as ray.init takes it (default: $RAY_ADDRESS, else a "
        "local cluster on this machine).",
    )


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL",
        help="Model: a local Hugging Face folder, a Hub repo id, or a built-in model name "
        f"({', '.join(BUILTIN_MODELS)}).",
    )
    serve.add_argument("--model", default=None, help="Same as the positional MODEL.")

    server = serve.add_argument_group("Server")
    server.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument(
        "--api-key", default=None,
        help=f"Require 'Authorization: Bearer KEY' on every endpoint but /health, /version "
        f"and /metrics (also from ${envs.API_KEY.name}).",
    )
    server.add_argument(
        "--metrics-require-api-key", action="store_true",
        help="With --api-key, require the key on /metrics too (the Prometheus scraper "
        "then needs it).",
    )
    server.add_argument(
        "--served-model-name", nargs="+", default=None,
        help="Name(s) the base model answers to in the API (default: MODEL).",
    )
    server.add_argument(
        "--chat-template", default=None,
        help="A Jinja chat template file that replaces the tokenizer's own.",
    )
    server.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="Accept a chat template in the request (chat_template, or chat_template in "
        "chat_template_kwargs). A template is code that runs in the server: refused by "
        "default.",
    )
    server.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Larger request bodies get 413.",
    )
    server.add_argument(
        "--shutdown-timeout", type=_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="On SIGTERM or SIGINT, stop taking requests and let those in flight finish "
        "for up to this long; then answer what still runs with 503 (a stream with an "
        "error event and [DONE]). 0: answer them at once.",
    )
    server.add_argument(
        "--generation-config", default="auto",
        help="Where unset sampling fields take their defaults from: 'auto' (the model's "
        "generation_config.json), 'vllm' (OpenAI's defaults only) or a folder holding a "
        "generation_config.json.",
    )
    server.add_argument(
        "--uvicorn-log-level", default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="Log level of uvicorn.",
    )
    server.add_argument(
        "--disable-uvicorn-access-log", action="store_true",
        help="Leave out uvicorn's log line for each HTTP request.",
    )
    server.add_argument(
        "--response-role", default="assistant",
        help="The role of chat answers to a generation prompt (add_generation_prompt).",
    )
    log_requests = server.add_mutually_exclusive_group()
    log_requests.add_argument(
        "--enable-log-requests", action="store_true",
        help="Log one line per request: its id, model, prompt length and sampling "
        "parameters (never the prompt's text). Off by default.",
    )
    log_requests.add_argument(
        "--disable-log-requests", action="store_true",
        help="Accepted for compatibility with vLLM; requests are not logged unless "
        "--enable-log-requests is given, so it changes nothing.",
    )
    server.add_argument(
        "--allowed-origins", type=_string_list, default=None, metavar="LIST",
        help='CORS: origins allowed, as a JSON list (\'["https://a.example"]\') or '
        "comma-separated (default: any, \"*\").",
    )
    server.add_argument(
        "--allowed-methods", type=_string_list, default=None, metavar="LIST",
        help="CORS: HTTP methods allowed (default: any).",
    )
    server.add_argument(
        "--allowed-headers", type=_string_list, default=None, metavar="LIST",
        help="CORS: request headers allowed (default: any).",
    )
    server.add_argument(
        "--allow-credentials", action="store_true",
        help="CORS: allow credentials (cookies, Authorization) in cross-origin requests.",
    )
    server.add_argument(
        "--root-path", default=None,
        help="The path prefix a reverse proxy serves the API under (FastAPI's root_path), "
        "e.g. /loraserve; the routes themselves stay where they are.",
    )
    server.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this key file.")
    server.add_argument(
        "--ssl-certfile", default=None, help="Serve HTTPS with this certificate file."
    )
    server.add_argument(
        "--ssl-ca-certs", default=None, help="CA certificates to check client certificates with."
    )
    server.add_argument(
        "--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
        help="Client certificates: 0 not asked for, 1 optional, 2 required "
        "(Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED).",
    )

    engine = serve.add_argument_group("Engine")
    engine.add_argument("--tokenizer", default=None, help="Tokenizer folder (default: MODEL).")
    engine.add_argument(
        "--revision", default=None,
        help="Branch, tag or commit of a Hub repo MODEL (refused for a local folder or a "
        "built-in model).",
    )
    engine.add_argument(
        "--tokenizer-revision", default=None,
        help="Branch, tag or commit of a Hub repo tokenizer (default: --revision).",
    )
    engine.add_argument(
        "--download-dir", default=None,
        help="Hugging Face Hub cache folder to download a Hub repo MODEL or tokenizer "
        "into (default: the Hub's own cache).",
    )
    engine.add_argument(
        "--trust-remote-code", action="store_true",
        help="Let transformers run code that a model's config or tokenizer ships (a "
        "tokenizer that needs it then loads). The model always runs loraserve's own "
        "implementation: no model code from the repo runs.",
    )
    engine.add_argument(
        "--dtype", default="auto",
        choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
        help="Weight and activation dtype.",
    )
    engine.add_argument(
        "--max-model-len", type=_positive_int, default=None,
        help="Context length (prompt + output); default: the model's.",
    )
    engine.add_argument(
        "--max-num-seqs", type=_positive_int, default=None,
        help="Most sequences per step (default: 256 on a GPU, 32 on the CPU).",
    )
    engine.add_argument(
        "--max-num-batched-tokens", type=_positive_int, default=None,
        help="Token budget per step; a longer prefill is chunked over several steps "
        "(default: 8192 on a GPU, 2048 on the CPU).",
    )
    engine.add_argument("--block-size", type=_positive_int, default=16, help="KV block size.")
    engine.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="Fraction of GPU memory for weights, activations and the KV cache.",
    )
    engine.add_argument(
        "--device", default="auto", choices=["auto", "cuda", "cpu"],
        help="Where to run the model (auto: cuda when available).",
    )
    engine.add_argument(
        "--enforce-eager", action="store_true", help="Never use CUDA graphs."
    )
    engine.add_argument(
        "--cudagraph-mode", type=str.upper, default=None, choices=list(CUDAGRAPH_MODES),
        help="Which steps replay CUDA graphs: FULL_DECODE_ONLY (default) captures decode "
        "steps whole; FULL_AND_PIECEWISE also captures the other steps (prefill chunks, "
        "prefill beside decodes) per token-count bucket in pieces, with attention run "
        "eagerly between them; NONE is --enforce-eager.",
    )
    engine.add_argument(
        "--specialize-active-lora", action="store_true",
        help="Also capture CUDA graphs without the LoRA ops, for steps that use no adapter "
        "(by default one graph set serves both).",
    )
    engine.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
        help="Schedule and launch each step before the previous step's tokens are back on "
        "the host, so scheduling overlaps the GPU (default: on). Steps with requests that "
        "use repetition, frequency or presence penalties wait for them as before.",
    )
    engine.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
        help="Reuse the KV cache blocks of a prompt prefix that an earlier request "
        "(with the same adapter, or none) computed (default: on).",
    )
    engine.add_argument(
        "--tensor-parallel-size", "-tp", type=_positive_int, default=1,
        help="Split the model over this many GPUs (or CPU processes), one process each: "
        "attention heads and MLP columns are sharded, the embedding and lm_head "
        "replicated (default: 1).",
    )
    engine.add_argument("--seed", type=int, default=0, help="Random seed (default: 0).")
    engine.add_argument(
        "--load-format", default="auto", choices=["auto", "dummy"],
        help="dummy: random weights from the model's config, for benchmarks.",
    )

    lora = serve.add_argument_group("LoRA")
    lora.add_argument("--enable-lora", action="store_true", help="Serve LoRA adapters.")
    lora.add_argument(
        "--lora-modules", nargs="+", type=parse_lora_module, default=None,
        metavar="NAME=PATH|JSON",
        help="Adapters to load at start-up: name=path, or JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ..., "pinned": true}\'.',
    )
    lora.add_argument(
        "--lora-resolvers", nargs="+", default=None, metavar="NAME",
        help="LoRA resolver plugins to run (entry points of loraserve.lora_resolvers), in "
        "the order they are asked; default: $LORASERVE_PLUGINS, else all installed. Needs "
        "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING=1.",
    )
    lora.add_argument(
        "--max-loras", type=_positive_int, default=None,
        help="Most distinct adapters in one step (device slots; default: 1).",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=None, choices=ALLOWED_LORA_RANKS,
        help="Largest adapter rank served (default: 16).",
    )
    lora.add_argument(
        "--max-cpu-loras", type=_positive_int, default=None,
        help="Adapters kept in CPU memory (default: --max-loras).",
    )
    lora.add_argument(
        "--lora-dtype", default=None, choices=["auto", "float16", "bfloat16", "float32"],
        help="dtype of the adapter weights (default: auto, the model's).",
    )
    lora.add_argument(
        "--lora-target-modules", nargs="+", default=None,
        help="Only these modules get LoRA (default: every supported module).",
    )
    lora.add_argument(
        "--fully-sharded-loras", action="store_true",
        help="With --tensor-parallel-size > 1, also shard A of column-parallel layers "
        "and B of row-parallel ones, gathering the small rank dimension instead "
        "(default: A replicated for column-parallel layers, B for row-parallel ones).",
    )
    add_vllm_compat_arguments(serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve",
        description="Serve many LoRA adapters of one base model, OpenAI-compatible.",
    )
    parser.add_argument("--version", action="version", version=loraserve.__version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(subparsers)
    _add_serve_ray_parser(subparsers)
    return parser


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig.from_kwargs arguments; unset options keep the engine's defaults."""
    kwargs: dict[str, Any] = {
        "model": args.model,
        "tokenizer": args.tokenizer,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager,
        "specialize_active_lora": args.specialize_active_lora or None,
        "cudagraph_mode": args.cudagraph_mode,
        "async_scheduling": args.async_scheduling,
        "load_format": args.load_format,
        "enable_lora": args.enable_lora,
        "max_loras": args.max_loras,
        "max_lora_rank": args.max_lora_rank,
        "max_cpu_loras": args.max_cpu_loras,
        "lora_dtype": args.lora_dtype,
        "lora_target_modules": args.lora_target_modules,
        "trust_remote_code": args.trust_remote_code,
        "revision": args.revision,
        "tokenizer_revision": args.tokenizer_revision,
        "download_dir": args.download_dir,
        "enable_prefix_caching": args.enable_prefix_caching,
        "tensor_parallel_size": args.tensor_parallel_size,
        "fully_sharded_loras": args.fully_sharded_loras or None,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


def validate_serve_args(args: argparse.Namespace) -> None:
    """Reject flag combinations that cannot work, before anything loads."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise CLIError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
    args.model = args.model or args.model_tag
    if not args.model:
        raise CLIError(f"a MODEL is required: loraserve {args.command} MODEL")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port must be in 1..65535, got {args.port}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise CLIError(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    check_vllm_compat_args(args)
    modules = args.lora_modules or []
    if not args.enable_lora:
        given = [flag for flag, value in (("--lora-modules", modules),
                                          ("--max-loras", args.max_loras),
                                          ("--max-lora-rank", args.max_lora_rank),
                                          ("--max-cpu-loras", args.max_cpu_loras),
                                          ("--lora-dtype", args.lora_dtype),
                                          ("--lora-resolvers", args.lora_resolvers),
                                          ("--lora-target-modules", args.lora_target_modules),
                                          ("--fully-sharded-loras", args.fully_sharded_loras))
                 if value]
        if given:
            raise CLIError(f"{', '.join(given)} needs --enable-lora")
    for name, default in _LORA_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    names = [m.name for m in modules]
    for name in names:
        reason = lora_name_error(name)
        if reason is not None:
            raise CLIError(f"--lora-modules: {reason}")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise CLIError(f"--lora-modules names must be unique; repeated: {duplicates}")
    served = args.served_model_name or [args.model]
    clash = sorted(set(names) & set(served))
    if clash:
        raise CLIError(f"adapter names {clash} clash with the served model name")
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise CLIError(
            f"--max-cpu-loras ({args.max_cpu_loras}) must be at least --max-loras "
            f"({args.max_loras})"
        )
    pinned = sum(m.pinned for m in modules)
    if pinned > args.max_loras:
        raise CLIError(f"{pinned} pinned adapters do not fit in --max-loras {args.max_loras}")
    if pinned == args.max_loras:
        # Pinned adapters never give up their slots: every other adapter would wait
        # for a slot for ever. Only safe when no other adapter can ever be asked for.
        others = [what for what, present in (
            ("the unpinned --lora-modules", pinned < len(modules)),
            ("adapters loaded at run time or found by resolvers "
             f"({envs.ALLOW_RUNTIME_LORA_UPDATING.name})",
             envs.ALLOW_RUNTIME_LORA_UPDATING.flag()),
        ) if present]
        if others:
            raise CLIError(
                f"{pinned} pinned adapters hold all --max-loras {args.max_loras} device slots "
                f"for good, leaving none for {' or '.join(others)}: pin fewer adapters or "
                "raise --max-loras"
            )
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(
        args.generation_config
    ):
        raise CLIError(f"--generation-config {args.generation_config!r} is not a folder")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise CLIError(f"--chat-template {args.chat_template!r} is not a file")
    _validate_tls_args(args)
    if args.root_path is not None and args.root_path and not args.root_path.startswith("/"):
        raise CLIError(f"--root-path must start with '/', got {args.root_path!r}")


def _validate_tls_args(args: argparse.Namespace) -> None:
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise CLIError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both")
    if not args.ssl_certfile and (args.ssl_ca_certs or args.ssl_cert_reqs):
        raise CLIError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and "
                       "--ssl-keyfile")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise CLIError("--ssl-cert-reqs asks for client certificates: it needs "
                       "--ssl-ca-certs to check them with")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile",
                       args.ssl_certfile), ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            raise CLIError(f"{flag} {path!r} is not a file")


def _or_any(values: list[str] | None) -> list[str]:
    return ["*"] if values is None else values


def build_server_settings(args: argparse.Namespace) -> tuple[ServerSettings, Any]:
    """The validated flags as the server's settings, and the model's tokenizer."""
    from loraserve.config import EngineConfig
    from loraserve.engine.tokenizer import eos_token_id, load_tokenizer
    from loraserve.entrypoints.api_server import CORSPolicy, ServerSettings
    from loraserve.entrypoints.serving_common import load_sampling_defaults

    # Built and checked once, here (a built-in model or a Hub repo is resolved once
    # too); the engine process gets this object as it is.
    try:
        config = EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
    except ValueError as exc:
        raise CLIError(str(exc)) from exc
    tokenizer = load_tokenizer(config)
    if args.chat_template:
        with open(args.chat_template) as f:
            tokenizer.chat_template = f.read()
    if args.generation_config == "vllm":
        sampling_defaults = {}
    else:
        source = (config.model_config.model if args.generation_config == "auto"
                  else args.generation_config)
        sampling_defaults = load_sampling_defaults(source)
    if sampling_defaults:
        logging.getLogger("loraserve.cli").info(
            "default sampling parameters from generation_config.json: %s", sampling_defaults
        )
    settings = ServerSettings(
        engine_config=config,
        served_model_names=args.served_model_name or [args.model],
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=args.api_key or envs.API_KEY.get() or None,
        lora_modules=args.lora_modules or [],
        lora_resolvers=args.lora_resolvers,
        eos_token_id=eos_token_id(tokenizer, config.model_config.hf_config),
        sampling_defaults=sampling_defaults,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        response_role=args.response_role,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        metrics_require_api_key=args.metrics_require_api_key,
        shutdown_timeout_s=args.shutdown_timeout,
        log_requests=args.enable_log_requests,
        cors=CORSPolicy(
            allow_origins=_or_any(args.allowed_origins),
            allow_methods=_or_any(args.allowed_methods),
            allow_headers=_or_any(args.allowed_headers),
            allow_credentials=args.allow_credentials,
        ),
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
    )
    return settings, tokenizer


def run_serve(args: argparse.Namespace) -> int:
    from loraserve.entrypoints.api_server import serve

    settings, tokenizer = build_server_settings(args)
    try:
        return asyncio.run(serve(settings, tokenizer))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


def validate_serve_ray_args(args: argparse.Namespace) -> None:
    """What `serve-ray` refuses on top of `serve`'s checks: the HTTP side is Ray
    Serve's proxy, which terminates no TLS and serves at the root."""
    given = [flag for flag, value in (("--ssl-keyfile", args.ssl_keyfile),
                                      ("--ssl-certfile", args.ssl_certfile),
                                      ("--root-path", args.root_path)) if value]
    if given:
        raise CLIError(f"{', '.join(given)}: not available with serve-ray (Ray Serve's HTTP "
                       "proxy answers); put a TLS proxy in front of it")
    if args.max_replicas is not None and args.max_replicas < args.num_replicas:
        raise CLIError(f"--max-replicas ({args.max_replicas}) must be at least "
                       f"--num-replicas ({args.num_replicas})")
    if args.target_ongoing_requests <= 0:
        raise CLIError("--target-ongoing-requests must be above 0")


def ray_options(args: argparse.Namespace) -> RayOptions:
    """The `serve-ray` flags as RayOptions (this imports Ray)."""
    from loraserve.ray.app import RayOptions

    return RayOptions(
        num_replicas=args.num_replicas,
        max_replicas=args.max_replicas,
        target_ongoing_requests=args.target_ongoing_requests,
        replica_num_cpus=args.replica_num_cpus,
        replica_num_gpus=args.replica_num_gpus,
        address=args.ray_address,
    )


def run_serve_ray(args: argparse.Namespace) -> int:
    try:
        from loraserve.ray.app import run_application
    except ImportError as exc:
        raise CLIError(f"serve-ray needs Ray Serve: pip install 'loraserve[ray]' ({exc})") from exc
    settings, tokenizer = build_server_settings(args)
    return run_application(settings, tokenizer, ray_options(args))


def validate_args(args: argparse.Namespace) -> None:
    """Every check of the command's flags."""
    validate_serve_args(args)
    if args.command == "serve-ray":
        validate_serve_ray_args(args)


def _command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # Errors about a subcommand's flags print that subcommand's usage.
    command_parser = _command_parsers(parser).get(argv[0] if argv else "", parser)
    try:
        argv = expand_config_file(argv, command_parser)
    except CompatError as exc:
        command_parser.error(str(exc))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command not in ("serve", "serve-ray"):
        parser.print_help()
        return 2
    prog = f"loraserve {args.command}"
    try:
        validate_args(args)
        logging.getLogger("loraserve.cli").info(
            "loraserve %s: %s %s (reading its config and tokenizer)", loraserve.__version__,
            args.command, args.model)
        return run_serve_ray(args) if args.command == "serve-ray" else run_serve(args)
    except (CLIError, CompatError) as exc:
        command_parser.exit(2, f"{prog}: error: {exc}\n")
    except OSError as exc:  # a busy port, an unreadable file
        command_parser.exit(1, f"{prog}: error: {exc}\n")
    except Exception as exc:  # noqa: BLE001 - start-up failures read as one clear line
        from loraserve.engine.core_client import EngineStartError

        if isinstance(exc, EngineStartError):
            command_parser.exit(1, f"{prog}: the engine failed to start: {exc}\n")
        if isinstance(exc, ValueError):
            command_parser.exit(1, f"{prog}: error: {exc}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
