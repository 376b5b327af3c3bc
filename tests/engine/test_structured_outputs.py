"""Constrained decoding end to end (xgrammar): random JSON schemas sampled at temperature 1 from a
random-weight model must always give JSON that validates, choices/regexes/grammars must match
exactly, grammar rows must not disturb the other rows of their batch, constraints that cannot
compile are refused up front (check()) or fail alone in the engine, and equal constraints
compile once.

The random-weight model is the point: it has no preference for well-formed output, so every
token that the mask lets through is eventually sampled (control characters, escapes, bytes that
are not UTF-8 on their own, long whitespace runs), and any hole in a grammar shows up as output
that does not parse or validate.

The schema test draws a fresh seed each run and names it in every failure; set
PAGODA_SO_SEED=<seed> to replay one.
"""

from __future__ import annotations

import json
import os
import random
import re
import uuid

import jsonschema
import pytest

from benchmarks.parity import random_prompts
from pagoda_daemon import LLM, SamplingParams
from pagoda_daemon.config import STRUCTURED_OUTPUTS_BACKENDS as BACKENDS
from pagoda_daemon.structured_outputs import (
    MAX_CHOICES,
    MAX_REGEX_CHARS,
    MAX_SCHEMA_DEPTH,
    StructuredOutputsParams,
)

SO = StructuredOutputsParams
MAX_NUM_SEQS = 64
MAX_TOKENS = 960  # the tiny models hold 1024 positions


@pytest.fixture(scope="module", params=BACKENDS)
def llm(tiny_models, request):
    # 128 blocks of 16 (2048 tokens): batches of 64 preempt, which grammar requests must survive
    return LLM(tiny_models["qwen3"], num_kv_blocks=128, max_model_len=1024, max_num_batched_tokens=512,
               max_num_seqs=MAX_NUM_SEQS, structured_outputs_backend=request.param)


def assert_nothing_left(llm: LLM) -> None:
    """No request left in the scheduler or the output processor, every KV block free."""
    core = llm.engine.core
    sched = core.scheduler
    assert not sched.running and not sched.waiting and not sched.requests and not sched.failed
    assert sched.num_needing_host_tokens == 0
    assert not llm.engine.has_unfinished_requests()
    kv = core.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and not kv.req_blocks, "blocks leaked"


# ---- 1. random JSON schemas ---------------------------------------------------------------------

ENUM_WORDS = ["alpha", "beta", "東京", "naïve", "two words", 'quote"d', "back\\slash", "🚀", "z", ""]


def random_string_schema(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.15:
        return {"type": "string", "enum": rng.sample(ENUM_WORDS, rng.randint(1, 4))}
    if r < 0.65:  # bounded both ways (the xgrammar path that _strict_json_strings repairs)
        low = rng.randint(0, 4)
        return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 6)}
    if r < 0.8:
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if r < 0.85:
        return {"type": "string", "minLength": rng.randint(1, 3)}
    return {"type": "string"}


def random_value_schema(rng: random.Random, depth: int) -> dict:
    kinds = ["string", "string", "integer", "number", "boolean", "null", "array"]
    if depth < 3:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "string":
        return random_string_schema(rng)
    if kind == "integer":
        schema: dict = {"type": "integer"}
        if rng.random() < 0.7:
            low = rng.randint(-1000, 1000)
            schema.update(minimum=low, maximum=low + rng.randint(0, 5000))
        elif rng.random() < 0.5:
            schema["minimum"] = rng.randint(-50, 50)
        return schema
    if kind in ("number", "boolean", "null"):
        return {"type": kind}
    if kind == "array":
        low = rng.randint(0, 2)
        if depth < 3 and rng.random() < 0.3:
            items = random_value_schema(rng, depth + 1)
        else:
            items = {"type": rng.choice(["integer", "number", "boolean", "null"])}
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + rng.randint(0, 3)}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 1) -> dict:
    """An object whose properties are all required (depth ≤ 3 objects, arrays inside)."""
    n = rng.randint(1, 4 if depth == 1 else 3)
    props = {f"k{i}{rng.choice('abxyz')}": random_value_schema(rng, depth) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


# Always in the batch: a bounded string the random model fills with every byte it may. Without
# the engine's _strict_json_strings (xgrammar writes such strings' characters as [^"\\\r\n],
# raw control characters included), these outputs do not parse as JSON.
BOUNDED_STRING = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 12},
                                                   "t": {"type": "string", "maxLength": 5}},
                  "required": ["s", "t"]}


def test_random_json_schemas_always_validate(llm):
    seed = int(os.environ.get("PAGODA_SO_SEED") or random.SystemRandom().randrange(2**32))
    rng = random.Random(seed)
    schemas = [BOUNDED_STRING] * 16 + [random_object_schema(rng) for _ in range(240)]
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=rng.randrange(2**31),
                             structured_outputs=SO(json=s)) for s in schemas]
    prompts = ["{", "Reply in JSON:", "The capital of France is", "東京"]
    preemptions = llm.get_stats().num_preemptions
    outs = []
    for start in range(0, len(params), MAX_NUM_SEQS):
        batch = params[start:start + MAX_NUM_SEQS]
        outs += llm.generate([prompts[i % len(prompts)] for i in range(len(batch))], batch)
    # 64 requests of tens to hundreds of tokens each overflow 128 blocks of 16: requests are
    # preempted and recomputed, and their grammars must carry on where they were
    assert llm.get_stats().num_preemptions > preemptions, "the cache was meant to be too small"

    cut = []
    for i, (schema, out) in enumerate(zip(schemas, outs)):
        done = out.outputs[0]
        where = f"PAGODA_SO_SEED={seed} schema #{i} {json.dumps(schema, ensure_ascii=False)} output {done.text!r}"
        if done.finish_reason == "length":
            cut.append(i)
            assert len(done.token_ids) == MAX_TOKENS, where
            continue
        # not "abort": the grammar refused no sampled token (the mask is what was sampled from)
        assert done.finish_reason == "stop" and done.stop_reason is None, (done.finish_reason, done.stop_reason, where)
        try:
            value = json.loads(done.text)
        except ValueError as e:
            raise AssertionError(f"not JSON ({e}): {where}") from e
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"does not validate ({e.message}): {where}") from e
    # Every output here is bounded but for whitespace (at most MAX_JSON_WHITESPACE per gap),
    # unbounded strings and number digits, which the random model ends within a few hundred
    # tokens (the longest seen in trials: ~700). A cut output is legal (the constraint
    # cannot finish it) but must stay rare: 2 % of the batch.
    assert len(cut) <= len(schemas) // 50, f"PAGODA_SO_SEED={seed}: {len(cut)} outputs cut by length: {cut}"
    assert_nothing_left(llm)


@pytest.mark.parametrize("length", [(1, 1), (0, 3), (2, 2), (None, 4), (1, None)])
def test_bounded_strings_take_json_characters_only(length):
    """The grammar itself (no model): xgrammar's bounded strings, in a rule or inlined (length 1),
    refuse raw control characters and surrogates, and take no escapes (as xgrammar's own rule:
    one with escapes made its masks 10-500x slower to fill); strings without bounds take them."""
    from xgrammar.testing import _get_matcher_from_grammar

    from pagoda_daemon.structured_outputs import build_grammar

    low, high = length
    string = {"type": "string", **({} if low is None else {"minLength": low}),
              **({} if high is None else {"maxLength": high})}
    schema = {"type": "object", "properties": {"s": string, "l": {"type": "array", "items": string, "maxItems": 2}},
              "required": ["s", "l"]}
    grammar = build_grammar(SO(json=schema))

    def accepts(char: bytes) -> bool:
        value = b'"' + char * max(low or 0, 1) + b'"'
        matcher = _get_matcher_from_grammar(grammar)
        return matcher.accept_string(b'{"s": ' + value + b', "l": [' + value + b"]}") and matcher.is_terminated()

    for char in [b"a", "é".encode(), "🚀".encode(), b"\x7f"]:
        assert accepts(char), (string, char)
    for char in [b"\x00", b"\x1f", b"\n", b"\t", b'"', b"\\", b"\\x", b"\\n", b"\\u00e9", b"\\ud83d",
                 b"\xed\xa0\x80"]:
        assert not accepts(char), (string, char)
    free = _get_matcher_from_grammar(build_grammar(SO(json={"type": "string"})))
    assert free.accept_string(b'"a\\n\\"\\u00e9"') and free.is_terminated()
    assert not _get_matcher_from_grammar(build_grammar(SO(json={"type": "string"}))).accept_string(b'"\xed\xa0\x80')


def test_properties_come_in_the_schema_order(llm):
    """As OpenAI and vLLM do: a schema's properties are generated in the order it lists them (a
    'reasoning' field before an 'answer' field must be written first)."""
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "null"},
                                               "mid": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["zeta", "alpha", "mid"]}
    outs = llm.generate(["{"] * 4, [SamplingParams(temperature=1.0, max_tokens=400, seed=s,
                                                   structured_outputs=SO(json=schema)) for s in range(4)])
    for out in outs:
        assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha", "mid"], out.outputs[0].text
    # the same schema as JSON text: same order
    text = json.dumps(schema)
    out = llm.generate(["{"], SamplingParams(temperature=1.0, max_tokens=400, seed=9,
                                             structured_outputs=SO(json=text)))[0]
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha", "mid"], out.outputs[0].text


# ---- 2. choice, regex, json_object, EBNF --------------------------------------------------------

CHOICES = ["yes", "no", "東京 🚀", "ab", "abc", 'say "hi"\\', "tab\there"]
REGEXES = [
    r"[a-c]{2,5}-\d{3}",
    r"\d{4}-\d{2}-\d{2}",
    r"[A-Z][a-z]{0,8}( [A-Z][a-z]{0,8}){0,2}",
    r"(東京|大阪|🚀)[0-9]{1,2}",
    r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)",
    r"-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,3})?",
    r"(ab|a)(bc|c)?x{0,3}",
]
# (EBNF, the same language as a Python regex)
GRAMMARS = [
    ('root ::= "a" [0-9]{1,5} "b"', r"a[0-9]{1,5}b"),
    ('root ::= item ("," item){0,3}\nitem ::= "x" | "yz" [a-c]{2}', r"(x|yz[a-c]{2})(,(x|yz[a-c]{2})){0,3}"),
    ('root ::= "(" ("é" | "日本" | [0-1]){1,6} ")"', r"\((é|日本|[0-1]){1,6}\)"),
]
SAMPLES = 12


def test_choice_regex_json_object_and_grammar_outputs_match(llm):
    cases: list[tuple[str, object, SO]] = [("choice", CHOICES, SO(choice=CHOICES))] * SAMPLES * 2
    cases += [("regex", r, SO(regex=r)) for r in REGEXES for _ in range(SAMPLES)]
    cases += [("grammar", py, SO(grammar=g)) for g, py in GRAMMARS for _ in range(SAMPLES)]
    cases += [("json_object", None, SO(json_object=True))] * SAMPLES
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, structured_outputs=c[2])
              for i, c in enumerate(cases)]
    outs = []
    for start in range(0, len(params), MAX_NUM_SEQS):
        batch = params[start:start + MAX_NUM_SEQS]
        outs += llm.generate(["Answer:"] * len(batch), batch)
    chosen = set()
    for (kind, want, _), out in zip(cases, outs):
        done = out.outputs[0]
        assert done.finish_reason == "stop", (kind, want, done.text, done.finish_reason)
        if kind == "choice":
            assert done.text in CHOICES, done.text
            chosen.add(done.text)
        elif kind in ("regex", "grammar"):
            # ASCII: \d and \w are [0-9] and [0-9a-zA-Z_] under both backends (as xgrammar reads them)
            assert re.fullmatch(want, done.text, flags=re.ASCII), (kind, want, done.text)
        else:
            assert isinstance(json.loads(done.text), dict), done.text
    assert len(chosen) >= 2, chosen  # seeded: a fixed set of samples, not a flaky one
    assert_nothing_left(llm)


def test_special_tokens_never_stand_in_for_their_text(llm):
    """The tiny tokenizer's <|pad|> and <|begin_of_text|> are special tokens whose text matches
    this regex in one token each; decoded with skip_special_tokens they would vanish (an empty
    output). The grammar must refuse them, so the text is spelled with ordinary tokens."""
    special = set(llm.tokenizer.all_special_ids)
    regex = r"<\|(pad|begin_of_text)\|>"
    outs = llm.generate(["Answer:"] * 16, [SamplingParams(temperature=1.0, max_tokens=64, seed=s,
                                                          structured_outputs=SO(regex=regex)) for s in range(16)])
    for out in outs:
        done = out.outputs[0]
        assert done.finish_reason == "stop" and re.fullmatch(regex, done.text), done
        assert not special & set(done.token_ids[:-1]), done.token_ids  # the last: the EOS that ends it


# ---- 3. grammar rows leave the other rows alone -------------------------------------------------

def test_unconstrained_rows_are_not_disturbed_by_grammar_rows(llm):
    vocab = llm.engine.model_config.vocab_size
    # a long prompt on each side: chunked (512 tokens a step), so steps hold rows that do not sample
    prompts = random_prompts(vocab, [5, 9, 13, 17, 700], seed=11)
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5),
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=6),
             SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7)]
    constraints = [SO(json=BOUNDED_STRING), SO(regex=r"[a-c]{2,5}-\d{3}"), SO(choice=CHOICES),
                   SO(grammar=GRAMMARS[1][0]), SO(json_object=True)]
    constrained = [SamplingParams(temperature=t, max_tokens=200, seed=20 + i, structured_outputs=c)
                   for i, (c, t) in enumerate(zip(constraints, [1.0, 0, 1.0, 0, 1.0]))]
    c_prompts = random_prompts(vocab, [7, 700, 3, 11, 6], seed=12)

    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    c_alone = [o.outputs[0].token_ids for o in llm.generate(c_prompts, constrained)]
    # interleaved: constrained, plain, constrained, plain, ...
    mixed = llm.generate([p for pair in zip(c_prompts, prompts) for p in pair],
                         [p for pair in zip(constrained, plain) for p in pair])
    assert [o.outputs[0].token_ids for o in mixed[1::2]] == alone
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == c_alone
    assert_nothing_left(llm)


# ---- 4. constraints that cannot compile -----------------------------------------------------------

def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(("field", "kwargs"), [
    ("regex", {"regex": "([a-z"}),
    ("regex", {"regex": "a{3,1}"}),
    ("grammar", {"grammar": "root ::= undefined_rule"}),
    ("grammar", {"grammar": 'root ::= "unterminated'}),
    ("grammar", {"grammar": 'not_root ::= "a"'}),
    ("json", {"json": {"type": "nonsense"}}),
    ("json", {"json": {"type": "integer", "minimum": 5, "maximum": 1}}),
    ("json", {"json": {"type": "string", "pattern": "(("}}),
    ("json", {"json": {"$ref": "#/nowhere"}}),
])
@pytest.mark.parametrize("backend", BACKENDS)
def test_check_refuses_what_cannot_compile(field, kwargs, backend):
    params = SO(**kwargs)  # the bounds pass: only compiling finds these
    with pytest.raises(ValueError, match=rf"^structured_outputs\.{field} cannot be compiled: \S"):
        params.check(backend)


@pytest.mark.parametrize(("prefix", "kwargs"), [
    ("structured_outputs.json is not valid JSON", {"json": '{"type": '}),
    ("structured_outputs.json must be a JSON schema", {"json": "[1, 2]"}),
    ("structured_outputs.json nests deeper than", {"json": _nested(MAX_SCHEMA_DEPTH + 1)}),
    ("structured_outputs.choice must list", {"choice": ["a"] * (MAX_CHOICES + 1)}),
    ("structured_outputs.choice must list", {"choice": []}),
    ("structured_outputs.choice must hold non-empty", {"choice": ["a", ""]}),
    ("structured_outputs.choice must not hold control characters", {"choice": ["ok", "bell\x07"]}),
    ("structured_outputs.regex must be a string", {"regex": "a" * (MAX_REGEX_CHARS + 1)}),
    ("structured_outputs.regex must be a string", {"regex": ""}),
    ("structured_outputs must set exactly one", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs must set exactly one", {"json_object": True, "grammar": 'root ::= "a"'}),
    ("structured_outputs must set exactly one", {}),
])
def test_bounds_are_refused_when_built(prefix, kwargs):
    with pytest.raises(ValueError, match="^" + re.escape(prefix)):
        SO(**kwargs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_themselves_are_accepted(backend):
    SO(json=_nested(MAX_SCHEMA_DEPTH)).check(backend)
    SO(choice=[str(i) for i in range(MAX_CHOICES)]).check(backend)
    SO(choice=["tab\tand\nnewline"]).check(backend)


def test_a_constraint_that_fails_in_the_engine_fails_alone(llm, caplog):
    """Past check() (the offline API does not call it): each bad request finishes aborted with
    the reason, the rest of the batch completes, nothing is left behind, and the engine serves
    the next batch."""
    llm.engine.core.scheduler.grammars.make_stats()
    bad = [SO(regex="([a-z"), SO(grammar="root ::= undefined_rule"), SO(json={"type": "nonsense"}),
           SO(regex="([a-z")]
    good = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=3, structured_outputs=SO(json=BOUNDED_STRING)),
            SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=4, structured_outputs=SO(regex=r"\d{4}"))]
    params = [SamplingParams(max_tokens=8, structured_outputs=b) for b in bad]
    order = [params[0], good[0], params[1], good[1], params[2], good[2], params[3]]
    outs = llm.generate(["The capital of France is"] * len(order), order)
    failed = [outs[i].outputs[0] for i in (0, 2, 4, 6)]
    reasons = {"xgrammar": ["Unclosed '['", 'Rule "undefined_rule" is not defined', 'Unsupported type "nonsense"'],
               "llguidance": ["unclosed character class", "Rule 'undefined_rule' not found", "Invalid type: nonsense"]}
    unclosed, undefined, nonsense = reasons[llm.engine.config.structured_outputs_backend]
    for out, reason in zip(failed, [unclosed, undefined, nonsense, unclosed]):
        assert out.finish_reason == "abort" and out.token_ids == [] and out.text == "", out
        assert out.stop_reason.startswith("structured output could not be compiled: "), out.stop_reason
        assert reason in out.stop_reason, out.stop_reason
    plain, json_out, digits = (outs[i].outputs[0] for i in (1, 3, 5))
    assert plain.finish_reason == "length" and len(plain.token_ids) == 8
    assert json_out.finish_reason == "stop"
    jsonschema.validate(json.loads(json_out.text), BOUNDED_STRING)
    assert digits.finish_reason == "stop" and re.fullmatch(r"\d{4}", digits.text)
    warned = [r.getMessage() for r in caplog.records if "structured output could not be compiled" in r.getMessage()]
    assert len(warned) == 4, warned  # logged, and caplog sees the scheduler's warnings
    stats = llm.engine.core.scheduler.grammars.make_stats()
    # the second "([a-z" shares the first's compile while it runs (3), or compiles anew if it failed already (4)
    assert stats.requests == 6 and stats.failures in (3, 4), stats
    assert_nothing_left(llm)
    # a failed compile is not kept: the same constraint fails (compiles) again; the engine still serves
    again = llm.generate(["x", "x"], [SamplingParams(max_tokens=4, structured_outputs=SO(regex="([a-z")),
                                      SamplingParams(temperature=0, max_tokens=4, structured_outputs=SO(choice=["ok"]))])
    assert again[0].outputs[0].finish_reason == "abort" and again[1].outputs[0].text == "ok"
    assert llm.engine.core.scheduler.grammars.make_stats().failures == 1
    assert_nothing_left(llm)


# ---- 5. the compile cache -------------------------------------------------------------------------

def test_equal_constraints_compile_once(llm):
    grammars = llm.engine.core.scheduler.grammars
    name = "p" + uuid.uuid4().hex[:8]  # a schema this engine has not compiled before
    schema = {"type": "object", "properties": {name: {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": [name]}
    grammars.make_stats()
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i, structured_outputs=SO(json=schema))
              for i in range(16)]
    # the same schema as JSON text is the same constraint; a regex is another one
    params.append(SamplingParams(temperature=1.0, max_tokens=64, seed=99, structured_outputs=SO(json=json.dumps(schema))))
    params.append(SamplingParams(temperature=1.0, max_tokens=64, seed=98,
                                 structured_outputs=SO(regex=name + r"[0-9]{2}")))
    outs = llm.generate(["{"] * len(params), params)
    for out in outs[:-1]:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert re.fullmatch(name + r"[0-9]{2}", outs[-1].outputs[0].text)
    stats = grammars.make_stats()
    assert (stats.requests, stats.compiles, stats.cache_hits, stats.failures) == (18, 2, 16, 0)
    assert len(stats.compile_seconds) == 2
    # one mask fill per step with constrained rows: at least one per token of the longest output
    assert len(stats.mask_fill_seconds) >= max(len(o.outputs[0].token_ids) for o in outs)
    assert all(0 < s < 10 for s in stats.mask_fill_seconds)
    # compiled already: the next batch only hits the cache, and the stats were reset by the read
    llm.generate(["{"] * 4, params[:4])
    stats = grammars.make_stats()
    assert (stats.requests, stats.compiles, stats.cache_hits) == (4, 0, 4)


# ---- 6. a constraint that starts after a token (a reasoning model's end of thinking) -------------

@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "ahead"])
def test_a_constraint_starts_after_its_token_and_not_before(tiny_models, async_scheduling):
    """With structured_outputs_after_token_id the output is free up to and including that token
    (the thinking and its `</think>`), then constrained. Greedy, the free part equals the
    unconstrained run token for token; the rest matches the regex in full. A request that never
    samples the token is never constrained."""
    llm = LLM(tiny_models["qwen3"], num_kv_blocks=128, max_model_len=512, async_scheduling=async_scheduling)
    prompts = random_prompts(llm.engine.model_config.vocab_size, [5, 17, 9], seed=31)
    free = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))]
    regex = r"[a-c]{2,5}-\d{3}"
    for prompt, unconstrained in zip(prompts, free):
        end = unconstrained[4]  # stands in for </think>: the greedy run samples it at position 4
        first = unconstrained.index(end)
        params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=SO(regex=regex),
                                structured_outputs_after_token_id=end)
        done = llm.generate([prompt], params)[0].outputs[0]
        assert done.token_ids[:first + 1] == unconstrained[:first + 1], "the free part was constrained"
        answer = llm.tokenizer.decode(done.token_ids[first + 1:], skip_special_tokens=True)
        assert done.finish_reason == "stop" and re.fullmatch(regex, answer), (answer, done.finish_reason)

    never = llm.engine.model_config.vocab_size - 1
    assert never not in free[0]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, structured_outputs=SO(regex=regex),
                            structured_outputs_after_token_id=never)
    assert llm.generate([prompts[0]], params)[0].outputs[0].token_ids == free[0]
    assert_nothing_left(llm)


# ---- 7. llguidance reads JSON schemas as xgrammar's strict mode does ------------------------------

def test_llguidance_objects_take_only_their_properties(tiny_models):
    """JSON Schema lets an object without additionalProperties take any other key; the engine's
    constraints (xgrammar's strict mode, OpenAI's strict outputs) do not, under either backend."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagoda_daemon.structured_outputs import build_llguidance_grammar

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    vocab = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "required": {"type": "object", "properties": {"b": {"type": "string"}}}}}

    def follows(text: str) -> bool:
        matcher = llguidance.LLMatcher(vocab, build_llguidance_grammar(SO(json=schema)))
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    assert follows('{"a": 1}') and follows('{"a": 1, "required": {"b": "x"}}')
    assert not follows('{"a": 1, "c": 2}')
    assert not follows('{"required": {"b": "x", "c": 1}}')


def test_llguidance_regexes_read_digits_and_word_characters_as_ascii(tiny_models):
    """\\d and \\w in a regex constraint mean [0-9] and [0-9a-zA-Z_] under llguidance too, as
    under xgrammar (vLLM's default backend) and in JSON Schema patterns; llguidance's own regexes
    would take any Unicode digit or letter. Literals and \\s stay Unicode."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from pagoda_daemon.structured_outputs import build_llguidance_grammar

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    vocab = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))

    def follows(pattern: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(vocab, build_llguidance_grammar(SO(regex=pattern)))
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    assert follows(r"[a-c]{2,4}-\d{3}", "bca-981") and not follows(r"[a-c]{2,4}-\d{3}", "bca-\u194f81")
    assert follows(r"\w+", "ab_9") and not follows(r"\w+", "abé")
    assert follows(r"a/b[\d\W]", "a/b7") and follows(r"a/b[\d\W]", "a/b-") and not follows(r"a/b[\d\W]", "a/bx")
    assert follows("東京 🚀|yes", "東京 🚀") and follows(r"\s+x", " \u00a0x")


def test_every_declared_backend_is_implemented():
    from pagoda_daemon.engine.grammar import BACKENDS as IMPLEMENTED

    assert tuple(IMPLEMENTED) == BACKENDS
