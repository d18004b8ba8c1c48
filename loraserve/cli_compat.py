"""What vLLM users bring to `loraserve serve` out of habit: vLLM's YAML `--config`
file, and vLLM's flags for behaviour that loraserve either has built in (accepted,
and `--help` says what they change) or does not offer (refused by name, with the
reason, rather than as an unknown flag)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

# The subcommands whose flags a --config file may hold.
_SERVE_COMMANDS = ("serve", "serve-ray")


class CompatError(ValueError):
    """A vLLM flag or config file that loraserve cannot honour; the message says why."""


def add_vllm_compat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "vLLM flags", "vLLM's flags, for commands and manifests written for vLLM: the ones "
        "loraserve has built in are accepted, the others are refused with the reason.")
    group.add_argument(
        "--config", default=None, metavar="FILE",
        help="A YAML file of flags, as vLLM reads it: `flag-name: value` per line "
        "(`max-loras: 4`, `enable-lora: true`, lists for flags that take several values). "
        "Flags on the command line win.",
    )
    group.add_argument(
        "--disable-log-stats", action="store_true",
        help="Accepted; changes nothing: loraserve logs no periodic stats (/metrics has them).",
    )
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
        help="Accepted: long prefills are always chunked to --max-num-batched-tokens. "
        "--no-enable-chunked-prefill is refused.",
    )
    group.add_argument(
        "--max-log-len", type=int, default=None, metavar="N",
        help="Accepted; changes nothing: logged requests never show their prompt.",
    )
    group.add_argument(
        "--swap-space", type=float, default=None, metavar="GIB",
        help="Accepted; changes nothing: a preempted request's KV cache is recomputed, "
        "never swapped to CPU memory.",
    )
    group.add_argument(
        "--kv-cache-dtype", default="auto",
        help="Only auto: the KV cache takes the model's dtype (fp8 caches are refused).",
    )
    group.add_argument(
        "--quantization", "-q", default=None,
        help="Refused: loraserve serves unquantized weights (see --dtype).",
    )
    group.add_argument(
        "--pipeline-parallel-size", "-pp", type=int, default=1,
        help="Only 1: split a model over GPUs with --tensor-parallel-size.",
    )
    group.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1,
        help="Only 1: run replicas with `loraserve serve-ray --num-replicas N`, or one "
        "server per GPU behind a router.",
    )


def check_vllm_compat_args(args: argparse.Namespace) -> None:
    """Refuse the vLLM flags whose value asks for something loraserve lacks."""
    if args.enable_chunked_prefill is False:
        raise CompatError("--no-enable-chunked-prefill: loraserve always chunks long prefills "
                          "(raise --max-num-batched-tokens to prefill more in one step)")
    if args.kv_cache_dtype != "auto":
        raise CompatError(f"--kv-cache-dtype {args.kv_cache_dtype} is not supported: the KV "
                          "cache takes the model's dtype (auto)")
    if args.quantization is not None:
        raise CompatError(f"--quantization {args.quantization} is not supported: loraserve "
                          "serves unquantized weights (--dtype)")
    if args.pipeline_parallel_size != 1:
        raise CompatError(f"--pipeline-parallel-size {args.pipeline_parallel_size} is not "
                          "supported: use --tensor-parallel-size to split the model")
    if args.data_parallel_size != 1:
        raise CompatError(f"--data-parallel-size {args.data_parallel_size} is not supported: "
                          "use `loraserve serve-ray --num-replicas N` for replicas")


def expand_config_file(argv: Sequence[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with a serve command's `--config FILE` replaced by the flags the file
    holds, placed before the command line's own flags so that those win (the same
    precedence as vLLM's)."""
    argv = list(argv)
    if not argv or argv[0] not in _SERVE_COMMANDS:
        return argv
    path, rest = _pop_config_flag(argv[1:])
    if path is None:
        return argv
    return [argv[0], *_positionals(rest), *config_file_flags(path, parser),
            *rest[len(_positionals(rest)):]]


def config_file_flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The flags a vLLM-style YAML config file sets, as command-line words."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        raise CompatError(f"--config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise CompatError(f"--config {path}: not valid YAML: {exc}") from exc
    if data is None:
        return []
    if not isinstance(data, dict):
        raise CompatError(f"--config {path}: must hold a mapping of flag names to values")
    known = _option_strings(parser)
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if flag not in known:
            raise CompatError(f"--config {path}: unknown flag {key!r}")
        words += _flag_words(flag, value, known)
    return words


def _pop_config_flag(words: list[str]) -> tuple[str | None, list[str]]:
    for i, word in enumerate(words):
        if word == "--config":
            if i + 1 >= len(words):
                raise CompatError("--config needs a FILE")
            return words[i + 1], words[:i] + words[i + 2:]
        if word.startswith("--config="):
            return word.split("=", 1)[1], words[:i] + words[i + 1:]
    return None, words


def _positionals(words: list[str]) -> list[str]:
    """The leading positional words (MODEL), which stay ahead of any flag."""
    lead = []
    for word in words:
        if word.startswith("-"):
            break
        lead.append(word)
    return lead


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _flag_words(flag: str, value: Any, known: set[str]) -> list[str]:
    if value is True:
        return [flag]
    if value is False:
        negated = "--no-" + flag[2:]
        return [negated] if negated in known else []
    if value is None:
        return []
    if isinstance(value, list):
        return [flag, *(_word(item) for item in value)]
    return [flag, _word(value)]


def _word(value: Any) -> str:
    # A mapping (a --lora-modules entry) travels as the JSON form the flag takes.
    return json.dumps(value) if isinstance(value, dict) else str(value)
