"""What a request may constrain its output to: a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF grammar (vLLM's ``structured_outputs``).

One declaration, shared by the offline `LLM`, the HTTP API (``response_format``,
``structured_outputs`` and the older ``guided_*`` fields all map here) and the engine core,
which compiles the constraint into token masks (``engine/grammar.py``). Every field is bounded,
and ``check()`` parses the constraint the way the engine will, so that a schema, regex or
grammar that cannot compile is a 400 naming the field before the request is queued (vLLM
learned to validate before queueing: a bad schema found in the engine fails late and alone).
The engine reads a constraint with llguidance (the default) or xgrammar
(``--structured-outputs-backend``); ``build_grammar`` and ``build_llguidance_grammar`` are the
two readings, and ``check`` uses the engine's.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

MAX_SCHEMA_CHARS = 256 * 1024  # a JSON schema, as JSON text
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays in a schema (xgrammar's converter recurses on them)
MAX_REGEX_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
# Whitespace a JSON constraint allows between two tokens of the JSON text. Unbounded, a model
# can loop on spaces or newlines until max_tokens (xgrammar's max_whitespace_cnt exists for
# that); 64 is far more than any formatting needs.
MAX_JSON_WHITESPACE = 64

KINDS = ("json", "json_object", "regex", "choice", "grammar")

_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# xgrammar's errors start with "[time] /path/file.cc:line: "
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (iterative: any depth)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, level)
            stack.extend((v, level + 1) for v in item)
    return deepest


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set. ``json``: a JSON schema (an object, or its JSON text);
    ``json_object``: any JSON object; ``regex``; ``choice``: the output is one of these
    strings; ``grammar``: EBNF (GBNF-style, as xgrammar and llama.cpp read it). Invalid values
    raise ValueError whose message starts with ``structured_outputs.<field>``."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        _ = self.key  # validates

    @functools.cached_property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        set_kinds = [k for k in KINDS if (self.json_object is not False if k == "json_object"
                                          else getattr(self, k) is not None)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_kinds) or 'none'}")
        return set_kinds[0], self._canonical(set_kinds[0])

    @staticmethod
    def _fail(name: str, message: str) -> ValueError:
        return ValueError(f"structured_outputs.{name} {message}")

    def _canonical(self, kind: str) -> str:
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                if len(schema) > MAX_SCHEMA_CHARS:
                    raise self._fail("json", f"may be at most {MAX_SCHEMA_CHARS} characters")
                try:
                    schema = json.loads(schema)
                except (ValueError, RecursionError) as e:
                    raise self._fail("json", f"is not valid JSON: {e}") from e
            if not isinstance(schema, (dict, bool)):
                raise self._fail("json", "must be a JSON schema (an object)")
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise self._fail("json", f"nests deeper than {MAX_SCHEMA_DEPTH} levels")
            # keys in the schema's order: properties are generated in that order (as OpenAI's and
            # vLLM's are), so two orders are two constraints
            text = json.dumps(schema, ensure_ascii=False)
            if len(text) > MAX_SCHEMA_CHARS:
                raise self._fail("json", f"may be at most {MAX_SCHEMA_CHARS} characters as JSON")
            return text
        if kind == "json_object":
            if self.json_object is not True:
                raise self._fail("json_object", "must be true or false")
            return ""
        if kind == "regex":
            if not isinstance(self.regex, str) or not 1 <= len(self.regex) <= MAX_REGEX_CHARS:
                raise self._fail("regex", f"must be a string of 1 to {MAX_REGEX_CHARS} characters")
            return self.regex
        if kind == "choice":
            choice = self.choice
            if not isinstance(choice, list) or not 1 <= len(choice) <= MAX_CHOICES:
                raise self._fail("choice", f"must list 1 to {MAX_CHOICES} strings")
            if any(not isinstance(c, str) or not 1 <= len(c) <= MAX_CHOICE_CHARS for c in choice):
                raise self._fail("choice", f"must hold non-empty strings of at most {MAX_CHOICE_CHARS} characters")
            if any(_CONTROL.search(c) for c in choice):
                raise self._fail("choice", "must not hold control characters other than tabs and line breaks")
            return json.dumps(choice, ensure_ascii=False)
        if not isinstance(self.grammar, str) or not 1 <= len(self.grammar) <= MAX_GRAMMAR_CHARS:
            raise self._fail("grammar", f"must be a string of 1 to {MAX_GRAMMAR_CHARS} characters")
        return self.grammar

    @property
    def kind(self) -> str:
        return self.key[0]

    def check(self, backend: str) -> None:
        """Parse the constraint as the engine's backend will, without a tokenizer: a ValueError
        naming the field when it cannot compile."""
        from pagoda_daemon.engine.grammar import BACKENDS

        validate = BACKENDS[backend].validate  # the engine's backends are its choices: a KeyError is a bug
        try:
            validate(self)
        except Exception as e:  # xgrammar raises RuntimeError from its C++ parsers
            if isinstance(e, ValueError) and str(e).startswith("structured_outputs."):
                raise  # already names the field
            raise self._fail(self.kind, f"cannot be compiled: {native_message(e)}") from e


def native_message(error: BaseException) -> str:
    """xgrammar's error text without its time stamp and source location."""
    return _NATIVE_PREFIX.sub("", str(error).strip()).strip()


def llguidance_message(error: str) -> str:
    """llguidance's error on one line: its caret lines and source echo dropped."""
    lines = [line.strip() for line in error.splitlines()]
    return " ".join(line for line in lines
                    if line and set(line) - {"^", " "} and not re.match(r"^\d+ \|", line))


def build_grammar(params: StructuredOutputsParams):
    """The xgrammar Grammar for these params (no tokenizer needed)."""
    import xgrammar as xgr

    kind, text = params.key
    if kind == "json":
        return _strict_json_strings(xgr.Grammar.from_json_schema(
            text, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE, strict_mode=True))
    if kind == "json_object":
        return _strict_json_strings(xgr.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE, strict_mode=False))
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":  # EBNF string literals take JSON's escapes
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                               for c in params.choice or []))
    return xgr.Grammar.from_ebnf(text)


# xgrammar 0.2.8 writes the characters of a string with minLength/maxLength as the class below
# (in a rule of its own, or inline where the length is exactly 1), which lets raw control
# characters through (JSON forbids them: the output does not parse). The replacement also
# leaves out the surrogates U+D800-DFFF, which xgrammar's classes let through as 3 bytes that
# are no UTF-8 (decoded, 3 U+FFFD: past maxLength). It takes no escapes, as xgrammar's own rule
# does not: a rule with escapes ((class | "\\" escape), JSON's full string character) made
# xgrammar compute masks at run time, 2.4 ms per token for a 64-character bound and 136 ms for
# 300 on one CPU core, which cost 96% of the throughput of a half-constrained batch on an H100
# (docs/benchmarks/2026-11-24-structured-outputs-h100.md).
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'
# Its strings without a length bound take this class: right but for the surrogates.
_BASIC_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_BASIC_STRING_CHAR_FIXED = r'[^\0-\x1f\"\\\r\n\uD800-\uDFFF]'


def _strict_json_strings(grammar):
    """The grammar with every string character as JSON allows it (see _LOOSE_STRING_CHAR)."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR).replace(_BASIC_STRING_CHAR, _BASIC_STRING_CHAR_FIXED)
    return grammar if fixed == text else xgr.Grammar.from_ebnf(fixed)


# llguidance reads a JSON schema as JSON Schema does: an object without additionalProperties
# takes any other key. xgrammar's strict mode, which the engine uses, and OpenAI's strict
# structured outputs allow only the listed ones; the schema given to llguidance says so.
_OBJECT_KEYS = ("properties", "patternProperties", "required")  # any of them: an object schema
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_NOT_SCHEMAS = ("enum", "const", "default", "examples", "required")  # values, not schemas


def _closed_objects(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object schema that leaves it out."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _closed_objects(sub) for name, sub in value.items()}
        elif key in _NOT_SCHEMAS:
            out[key] = value
        else:
            out[key] = _closed_objects(value)
    if _is_object(schema) and "additionalProperties" not in schema and "unevaluatedProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or any(k in schema for k in _OBJECT_KEYS)


def build_llguidance_grammar(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for these params (no tokenizer needed). JSON as build_grammar's:
    whitespace between tokens of at most MAX_JSON_WHITESPACE characters, objects closed; regexes
    with xgrammar's ASCII \\d and \\w."""
    import llguidance

    kind, text = params.key
    if kind in ("json", "json_object"):
        schema = _closed_objects(json.loads(text)) if kind == "json" else {"type": "object"}
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": {"whitespace_flexible": False, "whitespace_pattern":
                                               f"[\\x20\\x0A\\x0D\\x09]{{0,{MAX_JSON_WHITESPACE}}}"}}
        return llguidance.grammar_from("json_schema", json.dumps(schema, ensure_ascii=False))
    if kind == "regex":
        # \d and \w as ASCII classes ([0-9], [0-9a-zA-Z_]), as xgrammar (vLLM's default backend)
        # and JSON Schema patterns read them; llguidance's own regexes take every Unicode digit
        # (a tiny model at temperature 1 wrote "bca-᥏8𑽗" for [a-c]{2,4}-\d{3}, 2026-11-27)
        return llguidance.grammar_from("lark", "start: /" + llguidance.regex_to_lark(text, "dw") + "/")
    if kind == "choice":
        return llguidance.grammar_from("choice", text)
    return llguidance.grammar_from("grammar", text)  # GBNF (xgrammar's and llama.cpp's EBNF) or Lark
