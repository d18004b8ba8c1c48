"""Tool parsers: find the tool calls in a model's text, whole or as it streams.

The contract is vLLM's (``vllm.entrypoints.openai.tool_parsers``), so that a vLLM
tool-parser plugin ports by changing its imports: subclass ``ToolParser``,
implement ``extract_tool_calls`` and ``extract_tool_calls_streaming``, and register
the class with ``@ToolParserManager.register_module("name")``; the server loads
the plugin file named by ``--tool-parser-plugin``.

loraserve's own parsers derive from ``IncrementalToolParser``: each reads the text
so far into content and calls (``parse``), and one piece of code turns what is new
since the last call into stream deltas. Streamed pieces therefore add up to what
the whole answer gives.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loraserve.entrypoints.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
    random_tool_call_id,
)

logger = logging.getLogger(__name__)


class ToolParser:
    """Base of every tool parser; one instance parses one answer (one choice)."""

    def __init__(self, tokenizer: Any) -> None:
        self.model_tokenizer = tokenizer
        # vLLM's parsers keep their streaming state in these; plugins may too.
        self.prev_tool_call_arr: list[dict] = []
        self.current_tool_id: int = -1
        self.current_tool_name_sent: bool = False
        self.streamed_args_for_tool: list[str] = []

    @property
    def vocab(self) -> dict[str, int]:
        return self.model_tokenizer.get_vocab()

    def adjust_request(self, request: ChatCompletionRequest) -> ChatCompletionRequest:
        """Change the request before it is sampled (for example to keep the special
        tokens that mark a tool call in the text)."""
        return request

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        raise NotImplementedError

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        raise NotImplementedError

    def finish_streaming(self, current_text: str,
                         request: ChatCompletionRequest) -> DeltaMessage | None:
        """The last delta once the answer is complete: what the parser held back in
        case more text came (loraserve's addition; vLLM's parsers have nothing to
        add)."""
        return None


@dataclass
class ParsedCall:
    """A tool call in the text so far: its name once complete, and its arguments
    as far as they are certain (a prefix of the final ones)."""

    name: str | None = None
    arguments: str = ""
    # The call is whole (its arguments too).
    complete: bool = False


@dataclass
class ParsedOutput:
    """The text so far as content and tool calls; content is a prefix of the final
    content, each call's arguments a prefix of its final arguments."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    # The whole text is a well-formed answer of this parser's format (only asked
    # of a complete answer).
    well_formed: bool = True


class IncrementalToolParser(ToolParser):
    """A parser that reads the text so far; streaming sends what is new each time."""

    # Makes the id of each tool call.
    make_call_id: Callable[[], str] = staticmethod(random_tool_call_id)

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._content_sent = 0
        self._names_sent: list[bool] = []
        self._arguments_sent: list[int] = []

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """The text as content and calls. `final`: the text is the whole answer, so
        nothing is held back in case more text comes."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str,
                           request: ChatCompletionRequest) -> ExtractedToolCallInformation:
        parsed = self.parse(model_output, final=True)
        if not parsed.calls:
            return ExtractedToolCallInformation(tools_called=False, content=model_output)
        if not parsed.well_formed or not all(c.complete and c.name for c in parsed.calls):
            return ExtractedToolCallInformation(tools_called=False,
                                                content=self.unparsed_content(model_output))
        return ExtractedToolCallInformation(
            tools_called=True,
            tool_calls=[ToolCall(id=self.make_call_id(),
                                 function=FunctionCall(name=c.name, arguments=c.arguments))
                        for c in parsed.calls],
            content=parsed.content or None,
        )

    def unparsed_content(self, model_output: str) -> str:
        """The content of an answer whose tool calls do not parse."""
        return model_output

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: ChatCompletionRequest,
    ) -> DeltaMessage | None:
        return self._news(current_text, final=False)

    def finish_streaming(self, current_text: str,
                         request: ChatCompletionRequest) -> DeltaMessage | None:
        return self._news(current_text, final=True)

    def _news(self, text: str, final: bool) -> DeltaMessage | None:
        """What the text so far has that the deltas sent so far did not."""
        parsed = self.parse(text, final)
        content = parsed.content[self._content_sent:] or None
        self._content_sent = max(self._content_sent, len(parsed.content))
        deltas = []
        for index, call in enumerate(parsed.calls):
            if index == len(self._names_sent):
                self._names_sent.append(False)
                self._arguments_sent.append(0)
            if not self._names_sent[index]:
                if call.name is None:
                    break  # calls go out in order: the next waits for this name
                self._names_sent[index] = True
                self._arguments_sent[index] = len(call.arguments)
                deltas.append(DeltaToolCall(
                    index=index, id=self.make_call_id(), type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self._arguments_sent[index]:
                new = call.arguments[self._arguments_sent[index]:]
                self._arguments_sent[index] = len(call.arguments)
                deltas.append(DeltaToolCall(index=index,
                                            function=DeltaFunctionCall(arguments=new)))
        if content is None and not deltas:
            return None
        return DeltaMessage(content=content, tool_calls=deltas or None)


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`
    (to hold back from the content until the next text tells)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


# The parsers that ship with loraserve: name -> "module:class".
BUILTIN_TOOL_PARSERS = {
    "hermes": "loraserve.entrypoints.tool_parsers.hermes:HermesToolParser",
    "llama3_json": "loraserve.entrypoints.tool_parsers.llama3_json:Llama3JsonToolParser",
    "mistral": "loraserve.entrypoints.tool_parsers.mistral:MistralToolParser",
    "pythonic": "loraserve.entrypoints.tool_parsers.pythonic:PythonicToolParser",
}


class ToolParserManager:
    """The tool parsers by name, as vLLM's manager: the built-in ones, and those that
    plugins register. One registry for the process, as in vLLM: a plugin imports it
    and registers into it, so it cannot be handed to the plugin."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, force: bool = True,
                        module: type[ToolParser] | None = None) -> Any:
        """Register a parser class under `name` (or each name of a list; default: the
        class's name). Use as ``@ToolParserManager.register_module("name")`` or call
        with `module`."""

        def register(parser: type[ToolParser]) -> type[ToolParser]:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise TypeError(f"a tool parser must subclass ToolParser, got {parser!r}")
            names = [name] if isinstance(name, str) else list(name or [parser.__name__])
            for each in names:
                if each in cls.tool_parsers and not force:
                    raise KeyError(f"tool parser {each!r} is already registered")
                cls.tool_parsers[each] = parser
            return parser

        return register(module) if module is not None else register

    @classmethod
    def names(cls) -> list[str]:
        return sorted(set(BUILTIN_TOOL_PARSERS) | set(cls.tool_parsers))

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """The parser class called `name`; KeyError naming those there are, if none."""
        if name in cls.tool_parsers:
            return cls.tool_parsers[name]
        if name in BUILTIN_TOOL_PARSERS:
            module, _, attribute = BUILTIN_TOOL_PARSERS[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        raise KeyError(f"tool parser {name!r} is not registered; known: "
                       f"{', '.join(cls.names())}")

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Run a plugin file, which registers its parsers as it is imported (once:
        the file is not run again)."""
        if not os.path.isfile(plugin_path):
            raise ValueError(f"tool parser plugin {plugin_path!r} is not a file")
        name = os.path.splitext(os.path.basename(plugin_path))[0]
        loaded = sys.modules.get(name)
        if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "") or "") \
                == os.path.realpath(plugin_path):
            return
        spec = importlib.util.spec_from_file_location(name, plugin_path)
        if spec is None or spec.loader is None:
            raise ValueError(f"tool parser plugin {plugin_path!r} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise ValueError(f"tool parser plugin {plugin_path!r} failed to load: "
                             f"{type(exc).__name__}: {exc}") from exc
        logger.info("tool parser plugin %s loaded; parsers: %s", plugin_path,
                    ", ".join(cls.names()))


def load_tool_parser(name: str | None, plugin_path: str | None = None) -> type[ToolParser]:
    """The parser class called `name`, after running the plugin file if one is given
    (--tool-call-parser, --tool-parser-plugin); ValueError naming the problem."""
    if plugin_path:
        ToolParserManager.import_tool_parser(plugin_path)
    if not name:
        raise ValueError("no tool call parser is named")
    try:
        return ToolParserManager.get_tool_parser(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
