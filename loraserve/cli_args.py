"""The `serve` and `serve-ray` command lines: the parser, built from the option
classes, and the checks that are about the command line itself; what the checked
flags make of the server's settings. `loraserve.cli` runs the commands; the Ray
Serve application (`serve run`) parses its arguments here too."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from loraserve.cli_compat import (
    add_vllm_compat_arguments,
    check_vllm_compat_args,
)
from loraserve.config import EngineArgs
from loraserve.entrypoints.ray_options import RayOptions
from loraserve.entrypoints.server_args import ServerArgs
from loraserve.entrypoints.server_args import parse_lora_module as parse_lora_module  # noqa: F401
from loraserve.model.builtin import BUILTIN_MODELS
from loraserve.options import (
    OptionError,
    add_options,
    flag,
    is_set,
    lora_only,
    option_values,
)
from loraserve.version import __version__

if TYPE_CHECKING:
    from loraserve.entrypoints.api_server import ServerSettings

# The dataclasses whose fields are `serve`'s flags, and the --help sections they
# go in, in this order.
_OPTION_CLASSES = (ServerArgs, EngineArgs)
_GROUPS = ("Server", "Engine", "LoRA")


class CLIError(ValueError):
    """A flag or a combination of flags that cannot work; the message says why."""


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a default only where it says something (not None/False, not in the text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return f"{text} (default: %(default)s)"


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
    add_options(serve_ray, [RayOptions], groups=["Ray Serve"])


def _add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_tag", nargs="?", metavar="MODEL",
        help="Model: a local Hugging Face folder, a Hub repo id, or a built-in model name "
        f"({', '.join(BUILTIN_MODELS)}).",
    )
    add_options(serve, _OPTION_CLASSES, groups=_GROUPS)
    add_vllm_compat_arguments(serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loraserve",
        description="Serve many LoRA adapters of one base model, OpenAI-compatible.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(subparsers)
    _add_serve_ray_parser(subparsers)
    return parser


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineArgs (EngineConfig.from_kwargs) arguments that the flags set; unset
    options keep the engine's defaults."""
    return option_values(args, EngineArgs)


@contextmanager
def _options_as_flags() -> Iterator[None]:
    """An option that the options refuse is named by its flag."""
    try:
        yield
    except OptionError as exc:
        raise CLIError(exc.named(flag)) from exc


def validate_serve_args(args: argparse.Namespace) -> None:
    """Reject flag combinations that cannot work, before anything loads. The options
    check themselves (EngineArgs, ServerArgs); what is left here is about the command
    line: MODEL, flags that need --enable-lora, files that must exist. The checked
    options stay on args as args.engine_args and args.server_args."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise CLIError(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree")
    args.model = args.model or args.model_tag
    if not args.model:
        raise CLIError(f"a MODEL is required: loraserve {args.command} MODEL")
    check_vllm_compat_args(args)
    lora_fields = [f for cls in _OPTION_CLASSES for f in lora_only(cls)]
    given = [flag(f.name) for f in lora_fields if is_set(getattr(args, f.name))]
    if given and not args.enable_lora:
        raise CLIError(f"{', '.join(given)} needs --enable-lora")
    for f in lora_fields:  # left unset by the parser so that giving one can be told
        if getattr(args, f.name) is None:
            setattr(args, f.name, f.default)
    with _options_as_flags():
        args.engine_args = EngineArgs(**engine_kwargs_from_args(args))
        args.server_args = ServerArgs(**option_values(args, ServerArgs))
        args.server_args.check(args.engine_args)
    if args.generation_config not in ("auto", "vllm") and not os.path.isdir(
        args.generation_config
    ):
        raise CLIError(f"--generation-config {args.generation_config!r} is not a folder")
    if args.chat_template and not os.path.isfile(args.chat_template):
        raise CLIError(f"--chat-template {args.chat_template!r} is not a file")
    _validate_tls_args(args)


def _validate_tls_args(args: argparse.Namespace) -> None:
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise CLIError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs both")
    if not args.ssl_certfile and (args.ssl_ca_certs or args.ssl_cert_reqs):
        raise CLIError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and "
                       "--ssl-keyfile")
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise CLIError("--ssl-cert-reqs asks for client certificates: it needs "
                       "--ssl-ca-certs to check them with")
    for flag_name, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile",
                            args.ssl_certfile), ("--ssl-ca-certs", args.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            raise CLIError(f"{flag_name} {path!r} is not a file")


def build_server_settings(args: argparse.Namespace) -> tuple[ServerSettings, Any]:
    """The flags that validate_serve_args checked as the server's settings, and the
    model's tokenizer."""
    from loraserve.engine.tokenizer import eos_token_id, load_tokenizer
    from loraserve.entrypoints.api_server import ServerSettings
    from loraserve.entrypoints.serving_common import load_sampling_defaults

    # Built and checked once, here (a built-in model or a Hub repo is resolved once
    # too); the engine process gets this object as it is.
    try:
        config = args.engine_args.create_engine_config()
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
    server_args = args.server_args
    settings = ServerSettings(
        **vars(server_args),
        engine_config=config,
        served_model_names=server_args.served_model_name or [args.model],
        model=args.model,
        eos_token_id=eos_token_id(tokenizer, config.model_config.hf_config),
        sampling_defaults=sampling_defaults,
    )
    return settings, tokenizer


def validate_serve_ray_args(args: argparse.Namespace) -> None:
    """What `serve-ray` refuses on top of `serve`'s checks: the HTTP side is Ray
    Serve's proxy, which terminates no TLS and serves at the root."""
    given = [flag_name for flag_name, value in (("--ssl-keyfile", args.ssl_keyfile),
                                                ("--ssl-certfile", args.ssl_certfile),
                                                ("--root-path", args.root_path)) if value]
    if given:
        raise CLIError(f"{', '.join(given)}: not available with serve-ray (Ray Serve's HTTP "
                       "proxy answers); put a TLS proxy in front of it")
    with _options_as_flags():
        args.ray_options = RayOptions(**option_values(args, RayOptions))


def ray_options(args: argparse.Namespace) -> RayOptions:
    """The `serve-ray` flags that validate_serve_ray_args checked."""
    return args.ray_options


def validate_args(args: argparse.Namespace) -> None:
    """Every check of the command's flags."""
    validate_serve_args(args)
    if args.command == "serve-ray":
        validate_serve_ray_args(args)


def command_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(action.choices for action in parser._actions
                if isinstance(action, argparse._SubParsersAction))
