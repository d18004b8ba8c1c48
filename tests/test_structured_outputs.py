"""Structured outputs in the engine (CPU), checked as vLLM's tests check them: JSON
that validates against its schema, a regex's full match, membership in the
choices, a grammar's sentence, parseable JSON objects; each for the base model and
for adapters in one mixed batch. The tiny random model writes junk, which is what
makes a constraint visible: its unconstrained answers satisfy none of them.

Requests without a constraint in the same batch get exactly transformers+PEFT's
tokens, a request whose grammar is still compiling holds up nobody, and the grammar
layer refuses what xgrammar would not enforce."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch
from utils import hf_greedy

from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import StructuredOutputsConfig
from loraserve.engine.protocol import EngineCoreRequest
from loraserve.entrypoints.tool_parsers.partial_json import MalformedJSON, parse
from loraserve.structured_output.bitmask import TokenMask, apply_token_masks
from loraserve.structured_output.compiler import GrammarCompiler
from loraserve.structured_output.grammar import (
    GrammarError,
    build_grammar,
    check_schema,
    clean_error,
    is_lark,
)
from loraserve.structured_output.params import StructuredOutputsParams as SO
from loraserve.worker.sampler import Sampler, SamplingRow

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
CHOICES = ["red", "green", 'blue "sky"']
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
EBNF = 'root ::= "(" item ("," item){0,2} ")"\nitem ::= [a-c] | "x" [0-9]'
EBNF_LANGUAGE = r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9])){0,2}\)"
LARK = 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/'
LARK_LANGUAGE = r"<[a-z]{1,4}>"


def _json_valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


# name -> (constraint, does a whole answer satisfy it)
CONSTRAINTS = {
    "json": (SO(json=SCHEMA, disable_any_whitespace=True), _json_valid),
    "regex": (SO(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (SO(choice=CHOICES), lambda t: t in CHOICES),
    "ebnf": (SO(grammar=EBNF), lambda t: re.fullmatch(EBNF_LANGUAGE, t) is not None),
    "lark": (SO(grammar=LARK), lambda t: re.fullmatch(LARK_LANGUAGE, t) is not None),
    "json_object": (SO(json_object=True, disable_any_whitespace=True), _json_object),
}


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16)


@pytest.fixture(scope="module")
def loras(llama_adapters) -> list[LoRARequest | None]:
    return [None, LoRARequest("r8", 1, llama_adapters["r8"]),
            LoRARequest("r16_qv", 2, llama_adapters["r16_qv"])]


def _outputs(llm: LLM, batch: list[tuple[list[int], SamplingParams, LoRARequest | None]]):
    outs = llm.generate([{"prompt_token_ids": p} for p, _, _ in batch],
                        [params for _, params, _ in batch], [lora for _, _, lora in batch],
                        use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_constraints_hold_for_base_and_adapters_in_one_batch(llm, loras, prompts):
    batch = [(p, SamplingParams(temperature=0, max_tokens=64, structured_outputs=c), lora)
             for c, _ in CONSTRAINTS.values() for p in prompts[:2] for lora in loras]
    free = [(p, SamplingParams(temperature=0, max_tokens=64), lora)
            for p in prompts[:2] for lora in loras]
    outs = _outputs(llm, batch + free)
    constrained, unconstrained = outs[:len(batch)], outs[len(batch):]
    per = len(prompts[:2]) * len(loras)
    for i, (name, (_, holds)) in enumerate(CONSTRAINTS.items()):
        for out in constrained[i * per:(i + 1) * per]:
            if name == "json_object" and out.finish_reason == "length":
                # An object whose string runs past max_tokens: still a valid start.
                assert parse(out.text).kind == "object", out.text
                continue
            assert out.finish_reason == "stop", (name, out.text)
            assert holds(out.text), (name, out.text)
        # The junk the model writes unconstrained satisfies none of them.
        assert not any(holds(out.text) for out in unconstrained), name
    assert sum(o.finish_reason == "stop" for o in constrained[-per:]) >= 2
    # Adapters change the answers: the mix is real.
    assert len({o.text for o in constrained[:per]}) > 1


def test_any_whitespace_json_stays_a_valid_start_of_json(llm, loras, prompts):
    """By default JSON may put any whitespace between tokens (as vLLM): a weak model
    may spend its tokens on it, but never leaves JSON."""
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=SO(json=SCHEMA))
    for out in _outputs(llm, [(p, params, lora) for p in prompts[:2] for lora in loras]):
        node = parse(out.text)
        assert node is not None and node.kind == "object", out.text
        assert out.finish_reason == "length" or _json_valid(out.text)
    for out in _outputs(llm, [(prompts[0], SamplingParams(temperature=0, max_tokens=24), None)]):
        with pytest.raises(MalformedJSON):
            parse(out.text)


def test_sampled_constraints_hold_with_temperature_and_seeds(llm, loras, prompts):
    batch = [(prompts[2], SamplingParams(temperature=1.0, seed=seed, max_tokens=32,
                                         top_k=50, structured_outputs=CONSTRAINTS[name][0]),
              loras[seed % 3])
             for seed in range(3) for name in ("regex", "choice", "ebnf")]
    for (_, params, _), out in zip(batch, _outputs(llm, batch), strict=True):
        name = next(n for n, (c, _) in CONSTRAINTS.items()
                    if c is params.structured_outputs)
        assert out.finish_reason == "stop" and CONSTRAINTS[name][1](out.text), out.text


def test_unconstrained_requests_beside_grammars_get_peft_tokens(llm, loras, prompts,
                                                                  llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    free = [(prompts[3], greedy, lora) for lora in loras]
    mixed = free + [(p, SamplingParams(temperature=0, max_tokens=12,
                                       structured_outputs=c), lora)
                    for c, _ in CONSTRAINTS.values() for p in prompts[:2] for lora in loras]
    outs = _outputs(llm, mixed)[:len(free)]
    for (p, _, lora), out in zip(free, outs, strict=True):
        assert out.token_ids == hf_greedy(llama_dir, lora.lora_path if lora else None, p, 12)


def test_async_scheduling_gives_the_lockstep_answers(llm, llama_dir, loras, prompts):
    lockstep = LLM(llama_dir, enable_lora=True, max_loras=2, max_lora_rank=16,
                   async_scheduling=False)
    batch = [(p, SamplingParams(temperature=0, max_tokens=24, structured_outputs=c), lora)
             for c, _ in CONSTRAINTS.values() for p in prompts[2:] for lora in loras]
    batch += [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), lora)
              for p in prompts[2:] for lora in loras]
    assert llm.config.async_scheduling
    got = [(o.token_ids, o.finish_reason) for o in _outputs(llm, batch)]
    assert got == [(o.token_ids, o.finish_reason) for o in _outputs(lockstep, batch)]


def test_grammar_rows_are_sampled_after_their_step_is_launched(llm, loras, prompts,
                                                               monkeypatch):
    """A grammar row's mask needs the token still in flight: its row is sampled once
    that token is accepted, after its own step was launched, so steps keep
    overlapping; the masked logprobs come back with it (greedy: the chosen token
    is the most likely of them)."""
    engine = llm.engine
    deferred, overlapped = [], []
    sample, can_overlap = engine.executor.sample_deferred, engine._can_overlap
    monkeypatch.setattr(engine.executor, "sample_deferred",
                        lambda masks: (deferred.append(len(masks)), sample(masks)))
    monkeypatch.setattr(engine, "_can_overlap",
                        lambda: overlapped.append(can_overlap()) or overlapped[-1])
    json_params = SamplingParams(temperature=0, max_tokens=64, logprobs=2,
                                 structured_outputs=CONSTRAINTS["json"][0])
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    batch = [(prompts[0], json_params, loras[1]), (prompts[1], free, None),
             (prompts[2], json_params, None), (prompts[3], free, loras[2])]
    outs = _outputs(llm, batch)
    assert deferred and max(deferred) == 2
    assert overlapped and all(overlapped)
    for out in (outs[0], outs[2]):
        assert CONSTRAINTS["json"][1](out.text), out.text
        for token, position in zip(out.token_ids, out.logprobs, strict=True):
            assert position[token] == max(position.values())


def _request(request_id: str, prompt: list[int], params: SamplingParams,
             eos: int | None) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt,
                             sampling_params=params, eos_token_id=eos)


def test_a_compiling_grammar_holds_up_no_other_request(llm, prompts, monkeypatch):
    engine = llm.engine
    eos = llm.tokenizer.eos_token_id
    gate = threading.Event()
    compiled = []
    original = GrammarCompiler._compile

    def slow_compile(self, params):
        compiled.append(params.spec)
        assert gate.wait(60)
        return original(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    constraint = SO(regex="gate[0-9]{2}")
    for rid in ("g1", "g2"):
        engine.add_request(_request(rid, prompts[0], SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=constraint), eos))
    engine.add_request(_request("free", prompts[1], SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True), eos))
    tokens: dict[str, list[int]] = {"g1": [], "g2": [], "free": []}
    finished: set[str] = set()
    deadline = time.monotonic() + 60
    while "free" not in finished:
        assert time.monotonic() < deadline
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finished.add(out.request_id)
    # The unconstrained request ran to its end while the grammar compiled.
    assert len(tokens["free"]) == 6 and not tokens["g1"] and not tokens["g2"]
    assert engine.requests["g1"].waiting_for_grammar
    gate.set()
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            assert out.finish_reason in (None, "stop"), out.error
    for rid in ("g1", "g2"):
        text = llm.tokenizer.decode(tokens[rid], skip_special_tokens=True)
        assert re.fullmatch("gate[0-9]{2}", text), text
    # Both requests shared one compile.
    assert compiled == ["gate[0-9]{2}"]


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(llm, prompts):
    outs = _outputs(llm, [
        (prompts[0], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), None),
        (prompts[0], SamplingParams(max_tokens=4, structured_outputs=SO(regex="[a-")), None),
    ])
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 4
    assert outs[1].finish_reason == "error" and "Invalid regex" in outs[1].error


def test_min_tokens_that_the_grammar_cannot_allow_end_the_request_with_an_error(llm, prompts):
    (out,) = _outputs(llm, [(prompts[0], SamplingParams(
        temperature=0, max_tokens=8, min_tokens=4, structured_outputs=SO(choice=["a"])), None)])
    assert out.finish_reason == "error"
    assert "structured-output constraint" in out.error and "min_tokens" in out.error


# ---- the sampler's masks ------------------------------------------------------------


def _row(mask: TokenMask | None = None, greedy: bool = True) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0 if greedy else 1.0, seed=1), [1], [],
                       None, None, token_mask=mask)


def test_masks_touch_only_their_rows():
    vocab = 100
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    allowed = [5, 40, 99]
    for token in allowed:
        table[0, token // 32] |= 1 << (token % 32)
    rows = [_row(), _row(TokenMask(table, 0)), _row()]
    assert Sampler.argmax_suffices([rows[0], rows[2]])
    assert not Sampler.argmax_suffices(rows)
    masked = logits.clone()
    apply_token_masks(masked, [r.token_mask for r in rows])
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == allowed
    sampled = Sampler(torch.device("cpu")).sample(logits.clone(), rows).to_host().token_ids
    assert sampled[0] == int(logits[0].argmax()) and sampled[2] == int(logits[2].argmax())
    assert sampled[1] == max(allowed, key=lambda t: float(logits[1, t]))
    # Rows of different tables (not one step's, in order) are gathered.
    other = table.clone()
    again = logits.clone()
    apply_token_masks(again, [TokenMask(other, 0), None, TokenMask(table, 0)])
    assert torch.equal(again[1], logits[1])
    assert torch.isfinite(again[0]).sum() == torch.isfinite(again[2]).sum() == 3


# ---- the grammar layer ----------------------------------------------------------------


@pytest.mark.parametrize(("schema", "keyword"), [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "if"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "format": "credit-card"}, "format"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength"),
    ({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
    ({"anyOf": [{"type": "string"}, {"not": {}}]}, "not"),
])
def test_schema_keywords_xgrammar_does_not_enforce_are_refused(schema, keyword):
    with pytest.raises(GrammarError, match=f"'{re.escape(keyword)}'"):
        build_grammar(SO(json=schema), StructuredOutputsConfig())


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"},
                                      "format": {"type": "string"}}},
    {"type": "integer", "multipleOf": 3},
    {"type": "string", "format": "email"},
    {"allOf": [{"type": "integer"}]},
    True,
])
def test_schemas_xgrammar_enforces_pass(schema):
    check_schema(schema)
    build_grammar(SO(json=schema), StructuredOutputsConfig())


@pytest.mark.parametrize(("params", "words"), [
    (SO(json={"type": "bogus"}), 'Invalid JSON schema: Unsupported type "bogus"'),
    (SO(json="{not json"), "Invalid JSON schema: not valid JSON"),
    (SO(regex="[a-"), "Invalid regex"),
    (SO(grammar='root ::= "a" | b'), 'Invalid grammar: EBNF parser error at line 1, column 16'),
    (SO(grammar="start: undefined_rule"), "Invalid grammar"),
])
def test_constraints_without_a_grammar_name_the_problem(params, words):
    with pytest.raises(GrammarError) as info:
        build_grammar(params, StructuredOutputsConfig())
    assert str(info.value).startswith(words), str(info.value)
    assert ".cc:" not in str(info.value)  # no C++ source location


def test_clean_error_keeps_only_the_message():
    assert clean_error(RuntimeError("[18:38:13] /project/cpp/x.cc:94: Regex parsing error"
                                    "\n")) == "Regex parsing error"
    assert clean_error(RuntimeError("[1:2:3] /a.cc:1: Check failed: (e.empty()) is false: "
                                    "Bad")) == "Bad"


def _matcher_accepts(llama_dir: str, params: SO, text: str) -> bool:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(
        build_grammar(params, StructuredOutputsConfig())))
    return matcher.accept_string(text) and matcher.is_completed()


def test_length_bounded_strings_stay_json(llama_dir):
    params = SO(json={"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}},
                      "required": ["s"]}, disable_any_whitespace=True)
    assert _matcher_accepts(llama_dir, params, '{"s": "abcd"}')
    assert not _matcher_accepts(llama_dir, params, '{"s": "abcde"}')
    # A raw control character is not JSON (xgrammar alone would let it in).
    assert not _matcher_accepts(llama_dir, params, '{"s": "a\x1f"}')
    assert not _matcher_accepts(llama_dir, params, '{"s": "a\tb"}')


def test_choices_match_exactly_whatever_they_hold(llama_dir):
    choices = ['say "hi"', "back\\slash", "two\nlines", "😀 émoji", ""]
    params = SO(choice=choices)
    for choice in choices:
        assert _matcher_accepts(llama_dir, params, choice), choice
    for near in ['say "hi', "back\\\\slash", "two lines", "😀"]:
        assert not _matcher_accepts(llama_dir, params, near), near


def test_grammar_syntax_is_told_apart():
    assert not is_lark('root ::= "a"')
    assert not is_lark('# a comment\nroot ::= item\nitem ::= "x"')
    assert is_lark('start: "a" | "b"')
    assert is_lark("// root ::= in a comment\nstart: WORD\nWORD: /[a-z]+/")


@pytest.mark.parametrize(("fields", "words"), [
    ({}, "none is specified"),
    ({"regex": "a", "choice": ["a"]}, "multiple are specified: regex, choice"),
    ({"choice": []}, "must not be an empty list"),
])
def test_params_take_exactly_one_constraint(fields, words):
    with pytest.raises(ValueError, match=words):
        SO(**fields)


def test_params_cross_to_the_engine(llama_dir):
    import msgspec

    params = SamplingParams(structured_outputs=SO(json={"b": 1, "a": {"type": "string"}}))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert back.structured_outputs == params.structured_outputs
    # Key order is kept: it is the order the properties are written in.
    assert back.structured_outputs.json == '{"b": 1, "a": {"type": "string"}}'
