"""Chat templates rendered with bounds on their output, their values and their time.

transformers renders a template in jinja2's ImmutableSandboxedEnvironment, which
keeps it away from Python's internals but bounds neither its memory nor its time:
`{{ 'x' * 10**10 }}` asks for 10 GB at once, two nested loops run for minutes,
and the API server does both on a thread it cannot stop. So the server renders
every template here instead, as transformers' apply_chat_template does (the same
Jinja settings, globals and variables), with these limits:

- an operation whose result could outgrow its inputs (repetition, powers, padding
  and format widths, replace, join, indent, translate, JSON indentation) is
  refused before it runs when that result could pass `max_chars`, and every other
  operator, call, filter, `~` or output is refused when its inputs already do;
- the output stops at `max_chars`;
- a template stops once it runs past `timeout_s`: a trace hook sees every line of
  the template's own code, loops included.

A value may still reach a few times `max_chars` in one step (upper-casing or
escaping a long text), so the memory one render takes is a small multiple of the
limit, not an exact bound.
"""

from __future__ import annotations

import functools
import json
import re
import string
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from itertools import chain
from types import GeneratorType
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Longer request templates are refused: Jinja compiles a template in Python, outside
# any bound here. Hub chat templates are at most a few tens of kB.
MAX_TEMPLATE_CHARS = 128 * 1024
# transformers' marker for continue_final_message.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_DIGITS = re.compile(r"\d+")
_PERCENT_SPEC = re.compile(r"%[^a-zA-Z%]*[a-zA-Z%]")


class TemplateLimitError(jinja2.TemplateError):
    """A template went past one of the render's limits."""


class TooLarge(TemplateLimitError):
    """A value or the output would pass `max_chars`: more than the context holds."""


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, and json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the type itself, as transformers
    gives templates."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    """A namespace that refuses underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Namespace's signature
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot set underscore-prefixed names on a namespace ({name!r}).")


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the
    assistant's tokens for training; a rendered prompt keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _CheckedConcat(CodeGenerator):
    """`a ~ b` through the environment: Jinja joins the parts in one call that no
    sandbox hook sees."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:  # noqa: N802
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _size(value: Any, memo: dict[int, tuple[Any, int]]) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3 + 1
    if not isinstance(value, list | tuple | dict | set | frozenset):
        return 1
    known = memo.get(id(value))
    if known is not None:
        return known[1]
    memo[id(value)] = (value, 0)  # the entry keeps the id taken; a cycle counts once
    items = chain(value.keys(), value.values()) if isinstance(value, dict) else value
    total = len(value) + sum(_size(item, memo) for item in items)
    memo[id(value)] = (value, total)
    return total


def _listed(values: tuple) -> tuple:
    """The values with generators (what map, select and batch give) made lists, so
    that their size is known before anyone joins or prints them."""
    return tuple(list(v) if isinstance(v, GeneratorType) else v for v in values)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _replacements(text: str, old: Any) -> int:
    if not isinstance(old, str):
        return 0
    return text.count(old) if old else len(text) + 1


def _format_extra(fmt: str, widest: int) -> int:
    """What str.format can add to `fmt`: each field a copy of the widest argument,
    padded to the widths and precisions its spec names."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return 0  # the call itself says what is wrong
    extra = 0
    for _, name, spec, _ in fields:
        if name is not None:
            extra += widest + sum(int(d) for d in _DIGITS.findall(spec or ""))
    return extra


def _percent_extra(fmt: str, values: Any, widest: int) -> int:
    """What `fmt % values` can add to `fmt`, likewise; `*` takes a width from values."""
    specs = _PERCENT_SPEC.findall(fmt)
    extra = sum(widest + sum(int(d) for d in _DIGITS.findall(s)) for s in specs)
    if any("*" in s for s in specs):
        items = values if isinstance(values, tuple) else (values,)
        extra += sum(abs(v) for v in items if isinstance(v, int))
    return extra


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with the limits of this module.

    Safe to share between threads: a render's state lives in a thread-local."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _CheckedConcat

    def __init__(self, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=self._finalize,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.filters = {name: self._checked_filter(name, f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_TemplateNamespace)
        del self.globals["lipsum"]  # n paragraphs of filler: nothing a chat needs
        self._render = threading.local()
        self.compiled = functools.lru_cache(maxsize=32)(self.from_string)

    # -- sizes ----------------------------------------------------------------------

    def size(self, value: Any) -> int:
        """About the characters str(value) has: a container counts its items, each
        time it holds them, and is measured once a render (templates cannot change
        one)."""
        memo = getattr(self._render, "sizes", None)
        return _size(value, {} if memo is None else memo)

    def _check(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise TooLarge(
                f"The chat template would make a value of about {size} characters with "
                f"{what}, more than this server's limit of {self.max_chars}.")

    def _inputs(self, args: tuple, kwargs: dict) -> int:
        return sum(self.size(v) for v in chain(args, kwargs.values()))

    # -- the hooks ------------------------------------------------------------------

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        inputs = self.size(left) + self.size(right)
        if operator == "*":
            seq, n = (right, left) if isinstance(left, int) else (left, right)
            if isinstance(n, int) and isinstance(seq, str | list | tuple):
                inputs = self.size(seq) * n
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            inputs = abs(left).bit_length() * max(right, 0) // 3
        elif operator == "%" and isinstance(left, str):
            inputs += _percent_extra(left, right, self.size(right))
        self._check(inputs, f"'{operator}'")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        receiver = getattr(__obj, "__self__", None)
        args = _listed(args)
        inputs = __self._inputs(args, kwargs)
        if isinstance(receiver, str):
            inputs += len(receiver) + _str_method_extra(receiver, __obj.__name__, args, kwargs)
        __self._check(inputs, f"{getattr(__obj, '__name__', 'a call')}()")
        result = super().call(__context, __obj, *args, **kwargs)
        __self._check(__self.size(result), f"{getattr(__obj, '__name__', 'a call')}()")
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            fields = args[0] if value.__name__ == "format_map" and args else kwargs
            widest = max((self.size(v) for v in chain(args, fields.values()
                                                        if isinstance(fields, dict) else ())),
                         default=0)
            self._check(len(fmt) + _format_extra(fmt, widest), f"{value.__name__}()")
            return wrapped(*args, **kwargs)

        return functools.update_wrapper(checked, wrapped)

    def _checked_filter(self, name: str, f: Callable) -> Callable:
        # A filter that takes the context or environment gets it first.
        skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
        extra = _FILTER_EXTRA.get(name)

        @functools.wraps(f)
        def checked(*args: Any, **kwargs: Any) -> Any:
            args = _listed(args)
            own = args[skip:]
            inputs = self._inputs(own, kwargs)
            if extra is not None and own:
                try:
                    inputs += extra(self, *own, **kwargs)
                except TypeError:
                    pass  # wrong arguments: the filter itself says so
            self._check(inputs, f"the {name} filter")
            result = f(*args, **kwargs)
            self._check(self.size(result), f"the {name} filter")
            return result

        return checked

    def checked_concat(self, values: tuple) -> str:
        self._check(sum(self.size(v) for v in values), "'~'")
        return "".join(map(str, values))

    def _finalize(self, value: Any) -> Any:
        self._check(self.size(value), "an output")
        return value

    # -- rendering ------------------------------------------------------------------

    def render(self, source: str, timeout_s: float, variables: dict[str, Any]) -> str:
        """The template's output; TemplateLimitError past a limit."""
        template = self.compiled(source)
        deadline = time.monotonic() + timeout_s

        def line(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > deadline:
                raise TemplateLimitError(
                    f"The chat template ran past this server's time limit of {timeout_s:g} s.")
            return line

        def call(frame: Any, event: str, arg: Any) -> Any:
            # Only the code compiled from templates of this environment.
            return line if frame.f_globals.get("environment") is self else None

        parts, size = [], 0
        previous = sys.gettrace()
        self._render.sizes = {}
        generator = template.generate(**variables)
        sys.settrace(call)
        try:
            for part in generator:
                size += len(part)
                if size > self.max_chars:
                    raise TooLarge(
                        f"The chat template's output passed this server's limit of "
                        f"{self.max_chars} characters.")
                parts.append(part)
        finally:
            sys.settrace(previous)
            generator.close()
            self._render.sizes = None
        return "".join(parts)


def _str_method_extra(text: str, name: str, args: tuple, kwargs: dict) -> int:
    """What a str method can add beyond its inputs."""
    arg = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill"):
        return _int(arg if args else kwargs.get("width"))
    if name == "expandtabs":
        return text.count("\t") * _int(arg if args else kwargs.get("tabsize", 8))
    if name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        return _replacements(text, arg) * len(args[1])
    if name == "join" and isinstance(arg, list | tuple | str):
        return len(arg) * len(text)
    if name == "translate" and isinstance(arg, dict):
        return len(text) * max((len(v) for v in arg.values() if isinstance(v, str)), default=0)
    return 0


def _indent_extra(env: BoundedSandbox, s: Any, width: Any = 4, *args: Any, **kwargs: Any) -> int:
    lines = s.count("\n") + 1 if isinstance(s, str) else env.size(s)
    return lines * (len(width) if isinstance(width, str) else _int(width))


def _replace_extra(env: BoundedSandbox, s: Any, old: Any = None, new: Any = "",
                   *args: Any, **kwargs: Any) -> int:
    return _replacements(s, old) * env.size(new) if isinstance(s, str) else 0


def _join_extra(env: BoundedSandbox, value: Any, d: Any = "", *args: Any, **kwargs: Any) -> int:
    return env.size(value) * env.size(d)


def _format_filter_extra(env: BoundedSandbox, value: Any, *args: Any, **kwargs: Any) -> int:
    values = kwargs or args
    return _percent_extra(value, values, env.size(values)) if isinstance(value, str) else 0


def _tojson_extra(env: BoundedSandbox, value: Any, *args: Any, indent: Any = None,
                  **kwargs: Any) -> int:
    indent = args[1] if len(args) > 1 else indent
    return env.size(value) * _int(indent)


def _wordwrap_extra(env: BoundedSandbox, s: Any, *args: Any, wrapstring: Any = None,
                    **kwargs: Any) -> int:
    wrapstring = args[2] if len(args) > 2 else wrapstring
    return env.size(s) * env.size(wrapstring or "\n")


# Filters whose result can outgrow their inputs: what each can add.
_FILTER_EXTRA: dict[str, Callable[..., int]] = {
    "center": lambda env, value, width=80, *a, **k: _int(width),
    "indent": _indent_extra,
    "replace": _replace_extra,
    "join": _join_extra,
    "format": _format_filter_extra,
    "tojson": _tojson_extra,
    "wordwrap": _wordwrap_extra,
    "batch": lambda env, value, linecount=1, *a, **k: _int(linecount),
    "slice": lambda env, value, slices=1, *a, **k: _int(slices),
}


class ChatTemplateRenderer:
    """apply_chat_template(..., tokenize=False) of a tokenizer, in a BoundedSandbox."""

    def __init__(self, tokenizer: Any, max_chars: int, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.env = BoundedSandbox(max_chars)
        self.timeout_s = timeout_s

    def render(
        self,
        messages: list[dict[str, Any]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        if chat_template is not None and len(chat_template) > MAX_TEMPLATE_CHARS:
            raise TemplateLimitError(
                f"The chat template is {len(chat_template)} characters long, more than this "
                f"server's limit of {MAX_TEMPLATE_CHARS}.")
        source = self.tokenizer.get_chat_template(chat_template, tools)
        if continue_final_message:
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a final message with text.")
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        variables = {**self.tokenizer.special_tokens_map, **kwargs}
        rendered = self.env.render(source, self.timeout_s, {
            **variables, "messages": messages, "tools": tools, "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        })
        if continue_final_message:
            # As transformers: cut after the final message, keeping its spacing when
            # the template did.
            at = rendered.rfind(_CONTINUE_TAG.strip())
            if at < 0 or final.strip() not in rendered:
                raise ValueError("continue_final_message is set but the chat template does "
                                 "not show the final message.")
            if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
                rendered = rendered[:at]
            else:
                rendered = rendered[:at].rstrip()
        return rendered
