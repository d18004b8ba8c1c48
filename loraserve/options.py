"""Options written once: a dataclass field carries its flag's help, parsing, choices
and group in its metadata, and add_options() turns such fields into argparse flags.

The flag is the field's name (`max_loras` is `--max-loras`, and the parser's dest
stays `max_loras`), so a parsed namespace maps back onto the dataclass by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Option:
    help: str
    group: str | None = None  # the --help section; None: the parser's own
    aliases: tuple[str, ...] = ()  # short forms such as -tp
    type: Callable[[str], Any] | None = None  # None: int or float when the default is one
    choices: Sequence[Any] | None = None
    nargs: str | None = None
    metavar: str | None = None
    # Refused without --enable-lora. Unset on the command line (None), so that a
    # flag given without --enable-lora can be told from one left out.
    needs_lora: bool = False
    # Options that share a name here are mutually exclusive on the command line.
    exclusive: str | None = None


def option(default: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field that is also a command-line flag (see Option)."""
    if isinstance(default, list | dict | set):
        raise TypeError("an option's default must be immutable")
    return dataclasses.field(default=default, metadata={"option": Option(**meta)})


def options(cls: type) -> list[tuple[dataclasses.Field, Option]]:
    """The fields of `cls` that are flags, in order, each with its Option."""
    return [(f, f.metadata["option"]) for f in dataclasses.fields(cls) if "option" in f.metadata]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser, classes: Iterable[type],
                groups: Sequence[str] = ()) -> None:
    """Add the flags of the dataclasses in `classes`: those of no group first, then
    one argument group after the other in the order of `groups`, each in the order of
    `classes` and their fields, except that what needs --enable-lora follows it.

    A False default makes a store_true flag; a True default an --x/--no-x pair left
    unset (None) when neither is given, so that the dataclass default applies."""
    made = {name: parser.add_argument_group(name) for name in groups}
    order = [None, *groups]
    fields = sorted((fo for cls in classes for fo in options(cls)),
                    key=lambda fo: (order.index(fo[1].group), fo[1].needs_lora))
    exclusive: dict[str, Any] = {}
    for f, opt in fields:
        target: Any = parser if opt.group is None else made[opt.group]
        if opt.exclusive is not None:
            if opt.exclusive not in exclusive:
                exclusive[opt.exclusive] = target.add_mutually_exclusive_group()
            target = exclusive[opt.exclusive]
        target.add_argument(flag(f.name), *opt.aliases, dest=f.name, **_argparse_kwargs(f, opt))


def _argparse_kwargs(f: dataclasses.Field, opt: Option) -> dict[str, Any]:
    default = None if f.default is dataclasses.MISSING else f.default
    kwargs: dict[str, Any] = {"help": opt.help}
    if default is False:
        return {**kwargs, "action": "store_true"}
    if default is True:
        return {**kwargs, "action": argparse.BooleanOptionalAction, "default": None}
    kwargs["default"] = None if opt.needs_lora else default
    parse = opt.type or (type(default) if isinstance(default, int | float) else None)
    if parse is not None:
        kwargs["type"] = parse
    return kwargs | {name: getattr(opt, name) for name in ("choices", "nargs", "metavar")
                     if getattr(opt, name) is not None}


def option_values(namespace: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags of `cls` that the namespace sets, by field name; those left unset
    (None) are left out, so that the dataclass defaults apply."""
    values = {f.name: getattr(namespace, f.name) for f, _ in options(cls)}
    return {name: value for name, value in values.items() if value is not None}


def lora_only(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` whose flags need --enable-lora."""
    return [f for f, opt in options(cls) if opt.needs_lora]


def is_set(value: Any) -> bool:
    """Whether an option's value asks for something: None, False and [] do not."""
    return not (value is None or value is False or (isinstance(value, list) and not value))


class OptionError(ValueError):
    """A bad option value. The template names options as `{field_name}` and the
    values it shows as keyword arguments: str() names the options by field
    (max_cpu_loras), named(flag) as the command line's flags (--max-cpu-loras)."""

    def __init__(self, template: str, **values: Any) -> None:
        self.template, self.values = template, values
        super().__init__(self.named(str))

    def named(self, name: Callable[[str], str]) -> str:
        return self.template.format_map(_Names(self.values, name))


class _Names(dict):
    def __init__(self, values: Mapping[str, Any], name: Callable[[str], str]) -> None:
        super().__init__(values)
        self.name = name

    def __missing__(self, key: str) -> str:
        return self.name(key)


# ---- parsers of flag values -----------------------------------------------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_int_or_auto(text: str) -> int | str:
    """A count, or "auto": loraserve decides it at start-up."""
    return "auto" if str(text).strip().lower() == "auto" else positive_int(text)


def seconds(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text}")
    return value


def string_list(text: str) -> list[str]:
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
