"""The request fields that constrain the output, read as vLLM reads them, and the
check that the engine can compile the constraint, made before the request is
accepted (a 400 naming the problem otherwise).

Sources: OpenAI's ``response_format`` ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"schema": ...}}), vLLM's ``structured_outputs``
object and its older ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar`` fields (with ``guided_decoding_backend`` and
``guided_whitespace_pattern``), and in chat the schema of ``tool_choice``
"required" or a named function. A request may use one of them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from loraserve.entrypoints.errors import bad_request
from loraserve.structured_output.params import CONSTRAINTS, StructuredOutputsParams

if TYPE_CHECKING:
    from loraserve.config import StructuredOutputsConfig
    from loraserve.entrypoints.protocol import SamplingFields

# The options of vLLM's structured_outputs object besides the constraints.
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
            "disable_fallback")
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
# What vLLM's older per-request backend value may carry after its name.
_BACKEND_OPTIONS = {"disable-any-whitespace", "no-fallback", "disable-fallback",
                    "disable-additional-properties"}
# Checked constraints kept (their verdicts), so a schema sent again is not rebuilt.
_CHECKED_CACHE_SIZE = 256


@dataclass(frozen=True)
class Constraint:
    """A constraint from the request and the field it came from (for errors)."""

    params: StructuredOutputsParams
    param: str


def request_constraint(request: SamplingFields, backend: str,
                       extra: Constraint | None = None) -> Constraint | None:
    """The request's constraint, or None; a 400 for a malformed one or for more than
    one. `extra`: a constraint the endpoint adds (a tool choice's schema);
    `backend`: the server's (for a request that names one)."""
    found: list[tuple[str, dict[str, Any]]] = []
    options: dict[str, Any] = {}
    rf = _response_format(request.response_format)
    if rf is not None:
        found.append(("response_format", rf))
    if request.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(request.structured_outputs,
                                                                options)))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            found.append((name, {kind: value}))
    if request.guided_decoding_backend is not None:
        options.update(_backend_options(request.guided_decoding_backend, backend))
    if request.guided_whitespace_pattern is not None:
        options["whitespace_pattern"] = request.guided_whitespace_pattern
    if extra is not None:
        found.append((extra.param, {extra.params.kind: getattr(extra.params, extra.params.kind)}))
    if not found:
        return None
    if len(found) > 1 and extra is not None:
        raise bad_request("You can only either use constraints for structured outputs or "
                          f"tools, not both: {found[0][0]} is set beside a tool_choice that "
                          "calls a tool.", param="tool_choice")
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"A request takes one structured-output constraint; {names} are "
                          "both set. Use one of them.", param=found[1][0])
    param, constraint = found[0]
    try:
        # convert checks each field's type too (a number for a regex, ...).
        params = msgspec.convert({**constraint, **options}, StructuredOutputsParams)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise bad_request(f"{param}: {exc}", param=param) from exc
    return Constraint(params, param)


def _response_format(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """response_format as a constraint; None for text."""
    if value is None:
        return None
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("When response_format type is 'json_schema', the 'json_schema' "
                              "field must be provided.", param="response_format")
        schema = spec.get("schema")
        if not isinstance(schema, dict | bool):
            raise bad_request("response_format.json_schema.schema must be a JSON schema "
                              "object.", param="response_format")
        return {"json": schema}
    raise bad_request(f"response_format type {kind!r} is not supported; use 'text', "
                      "'json_object' or 'json_schema'.", param="response_format")


def _structured_outputs(value: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """vLLM's structured_outputs object: its constraint (returned) and its options
    (into `options`)."""
    if value.get("structural_tag") is not None:
        raise bad_request("structured_outputs.structural_tag is not supported by this "
                          "server.", param="structured_outputs")
    known = set(CONSTRAINTS) | set(_OPTIONS) | {"structural_tag"}
    unknown = sorted(key for key in value if key not in known and not key.startswith("_"))
    if unknown:
        raise bad_request(f"structured_outputs has unknown fields {unknown}; known: "
                          f"{sorted(known - {'structural_tag'})}.", param="structured_outputs")
    for key in _OPTIONS:
        if value.get(key) is not None and key != "disable_fallback":
            options[key] = value[key]
    return {key: value[key] for key in CONSTRAINTS if value.get(key) is not None}


def _backend_options(text: str, backend: str) -> dict[str, Any]:
    """guided_decoding_backend: vLLM takes no per-request backend other than the
    server's; its options (after a colon) still apply."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if name not in ("auto", "xgrammar", backend):
        raise bad_request(
            f"Request-level structured output backend selection is not supported. The request "
            f"specified {name!r}, but this server uses xgrammar. Remove guided_decoding_backend "
            "from the request.", param="guided_decoding_backend")
    options: dict[str, Any] = {}
    for option in filter(None, (o.strip() for o in rest.split(","))):
        if option not in _BACKEND_OPTIONS:
            raise bad_request(f"guided_decoding_backend option {option!r} is not supported; "
                              f"known: {sorted(_BACKEND_OPTIONS)}.",
                              param="guided_decoding_backend")
        if option == "disable-any-whitespace":
            options["disable_any_whitespace"] = True
    return options


class GrammarChecker:
    """Builds a constraint's grammar, as the engine will, to refuse one it could not
    compile; verdicts are kept for the constraints seen most recently."""

    def __init__(self, config: StructuredOutputsConfig) -> None:
        self.config = config
        self._verdict = functools.lru_cache(maxsize=_CHECKED_CACHE_SIZE)(self._check_key)

    def check(self, constraint: Constraint) -> None:
        """A 400 naming the problem when the constraint has no grammar. Runs
        xgrammar (milliseconds for a large schema): call it off the event loop."""
        from loraserve.structured_output.grammar import any_whitespace

        params = constraint.params
        error = self._verdict(params.cache_key(any_whitespace(params, self.config)))
        if error is not None:
            raise bad_request(f"{constraint.param}: {error}", param=constraint.param)

    def _check_key(self, key: tuple[str, str, bool]) -> str | None:
        from loraserve.structured_output.grammar import GrammarError, build_grammar

        kind, spec, any_ws = key
        value: Any = True if kind == "json_object" else spec
        if kind == "choice":
            value = json.loads(spec)
        params = StructuredOutputsParams(**{kind: value}, disable_any_whitespace=not any_ws)
        try:
            build_grammar(params, self.config)
        except GrammarError as exc:
            return str(exc)
        return None
