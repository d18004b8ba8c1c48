"""The `loraserve` command: `loraserve serve MODEL [options]`, with vLLM's flags."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from loraserve.cli_args import (
    CLIError,
    build_parser,
    build_server_settings,
    command_parsers,
    ray_options,
    validate_args,
)
from loraserve.cli_compat import CompatError, expand_config_file
from loraserve.log import configure_logging
from loraserve.version import __version__


def run_serve(args: argparse.Namespace) -> int:
    from loraserve.entrypoints.api_server import serve

    settings, tokenizer = build_server_settings(args)
    try:
        return asyncio.run(serve(settings, tokenizer))
    except (KeyboardInterrupt, asyncio.CancelledError):
        return 0


def run_serve_ray(args: argparse.Namespace) -> int:
    try:
        from loraserve.ray.app import run_application
    except ImportError as exc:
        raise CLIError(f"serve-ray needs Ray Serve: pip install 'loraserve[ray]' ({exc})") from exc
    settings, tokenizer = build_server_settings(args)
    return run_application(settings, tokenizer, ray_options(args))


def main(argv: list[str] | None = None) -> int:
    configure_logging()
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # Errors about a subcommand's flags print that subcommand's usage.
    command_parser = command_parsers(parser).get(argv[0] if argv else "", parser)
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
            "loraserve %s: %s %s (reading its config and tokenizer)", __version__,
            args.command, args.model)
        return run_serve_ray(args) if args.command == "serve-ray" else run_serve(args)
    except (CLIError, CompatError) as exc:
        command_parser.exit(2, f"{prog}: error: {exc}\n")
    except OSError as exc:  # a busy port, an unreadable file
        command_parser.exit(1, f"{prog}: error: {exc}\n")
    except Exception as exc:  # noqa: BLE001 - start-up failures read as one clear line
        from loraserve.entrypoints.core_client import EngineStartError

        if isinstance(exc, EngineStartError):
            command_parser.exit(1, f"{prog}: the engine failed to start: {exc}\n")
        if isinstance(exc, ValueError):
            command_parser.exit(1, f"{prog}: error: {exc}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
