"""Mask-fill time of the structured-outputs benchmark's schemas on the CPU alone (no model, no
GPU): where the engine's grammar costs go, checkable on any machine.

    python -m benchmarks.structured_mask_cpu [--tokenizer DIR] [--variants engine,xgrammar]
                                             [--batch 128 --threads 1,2,4,8]

For each schema (benchmarks/structured_schemas.py) and each grammar variant, one matcher walks
an output drawn uniformly among the allowed tokens (what random weights sample), and the time of
each fill_next_token_bitmask is summed. Variants:

  engine      pagoda_daemon.structured_outputs.build_grammar, as the engine compiles it
  xgrammar    xgrammar's own from_json_schema(any_whitespace=True), as vLLM 0.26 builds it
              (no whitespace bound, no string fixes)
  llguidance  llguidance's JSON schema support, whitespace bounded as the engine bounds it

With --string-probe, one fill inside a JSON string value is timed for strings without a bound
and with maxLength 300, as the engine and as xgrammar's own from_json_schema build them: the
cost of length-bounded strings, which every schema of the benchmark has.

With --batch N, the engine's fill is also timed as the engine core does it, with each of its
backends (engine/grammar.py: xgrammar's BatchGrammarMatcher, llguidance's executor): N matchers
(the schemas in turn, each stopped at a random point of its own walk) filled at once, once per
thread count in --threads; the line reports the CPUs this process may run on.

Without --tokenizer the synthetic Qwen3-size tokenizer is built (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--variants", default="engine,xgrammar")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0, help="also time batch fills of this many matchers")
    ap.add_argument("--threads", default="1,2,4,8", help="thread counts for the batch fills")
    ap.add_argument("--batch-backends", default="xgrammar,llguidance", help="the engine's backends to batch-fill with")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--string-probe", action="store_true", help="time fills inside bounded and unbounded strings")
    a = ap.parse_args()

    import numpy as np
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from benchmarks.structured_schemas import SCHEMAS, validate
    from pagoda_daemon import structured_outputs as so

    tmp = None
    if a.tokenizer is None:
        from benchmarks.synthetic_tokenizer import build

        tmp = tempfile.TemporaryDirectory(prefix="pagoda-synth-tok-")
        a.tokenizer = build(tmp.name)
    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=a.vocab_size, stop_token_ids=[tok.eos_token_id])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def llguidance_walk(schema: dict, si: int) -> None:
        import llguidance
        import llguidance.numpy

        lltok = llguidance_tokenizer()
        grm = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={
            "whitespace_flexible": False, "whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{so.MAX_JSON_WHITESPACE}}}"})
        t = time.perf_counter()
        matcher = llguidance.LLMatcher(lltok, grm, log_level=1)
        compile_s = time.perf_counter() - t
        assert not matcher.is_error(), matcher.get_error()
        rng = np.random.default_rng(a.seed)
        mask = np.zeros((1, -(-a.vocab_size // 32)), dtype=np.int32)
        out, fill = [], 0.0
        while len(out) < a.max_tokens and not matcher.is_stopped():
            t = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            fill += time.perf_counter() - t
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:a.vocab_size]
            token = int(rng.choice(np.flatnonzero(bits)))
            assert matcher.consume_token(token), matcher.get_error()
            out.append(token)
        done = matcher.is_stopped()
        err = validate(tok.decode(out, skip_special_tokens=True), si) if done else "unfinished"
        print("RESULT " + json.dumps({
            "variant": "llguidance", "schema": schema["title"], "compile_s": round(compile_s, 3), "tokens": len(out),
            "fill_us_per_token": round(fill / len(out) * 1e6, 1), "finished": done, "valid": err is None,
            **({"why": err[:120]} if err else {})}), flush=True)

    cached: dict[str, object] = {}

    def llguidance_tokenizer():
        if "tok" not in cached:
            import llguidance.hf

            cached["tok"] = llguidance.hf.from_tokenizer(tok, n_vocab=a.vocab_size)
        return cached["tok"]

    def grammar(variant: str, schema: dict):
        if variant == "xgrammar":
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
        return so.build_grammar(so.StructuredOutputsParams(json=schema))

    def allowed(mask) -> np.ndarray:
        return np.flatnonzero(np.unpackbits(np.asarray(mask).view(np.uint8), bitorder="little")[:a.vocab_size])

    for variant in a.variants.split(","):
        for si, schema in enumerate(SCHEMAS):
            if variant == "llguidance":
                llguidance_walk(schema, si)
                continue
            t = time.perf_counter()
            compiled = compiler.compile_grammar(grammar(variant, schema))
            compile_s = time.perf_counter() - t
            rng = np.random.default_rng(a.seed)
            matcher = xgr.GrammarMatcher(compiled)
            mask = xgr.allocate_token_bitmask(1, a.vocab_size)
            out, fill = [], 0.0
            while len(out) < a.max_tokens and not matcher.is_terminated():
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(mask)
                fill += time.perf_counter() - t
                token = int(rng.choice(allowed(mask)))
                assert matcher.accept_token(token)
                out.append(token)
            done = matcher.is_terminated()
            err = validate(tok.decode(out, skip_special_tokens=True), si) if done else "unfinished"
            print("RESULT " + json.dumps({
                "variant": variant, "schema": schema["title"], "compile_s": round(compile_s, 3), "tokens": len(out),
                "fill_us_per_token": round(fill / len(out) * 1e6, 1), "finished": done, "valid": err is None,
                **({"why": err[:120]} if err else {})}), flush=True)

    if a.string_probe:
        mask = xgr.allocate_token_bitmask(1, a.vocab_size)
        for bound in (None, 300):
            string = {"type": "string"} if bound is None else {"type": "string", "maxLength": bound}
            schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
            for builder in ("engine", "xgrammar"):
                matcher = xgr.GrammarMatcher(compiler.compile_grammar(grammar(builder, schema)))
                for token in tok.encode('{"s": "', add_special_tokens=False):
                    assert matcher.accept_token(token)
                t = time.perf_counter()
                for _ in range(a.repeats):
                    matcher.fill_next_token_bitmask(mask)
                print("RESULT " + json.dumps({
                    "string_probe": builder, "max_length": bound,
                    "fill_us": round((time.perf_counter() - t) / a.repeats * 1e6, 1),
                    "allowed_tokens": len(allowed(mask))}), flush=True)

    if a.batch:
        from pagoda_daemon.engine.grammar import BACKENDS

        for name in a.batch_backends.split(","):
            for threads in (int(x) for x in a.threads.split(",")):
                backend = BACKENDS[name](tok, a.vocab_size, [tok.eos_token_id], threads)
                compiled = [backend.compile(so.StructuredOutputsParams(json=schema)) for schema in SCHEMAS]
                rng = np.random.default_rng(a.seed + 1)  # the same walks for every backend and thread count
                one = np.empty((1, -(-a.vocab_size // 32)), dtype=np.int32)
                matchers = []
                for i in range(a.batch):
                    matcher = backend.new_matcher(compiled[i % len(compiled)])
                    for _ in range(int(rng.integers(0, 250))):  # a random point of its own walk
                        backend.fill([matcher], one)
                        tokens = allowed(one[0])
                        token = int(rng.choice(tokens))
                        if token == tok.eos_token_id and len(tokens) > 1:
                            token = int(rng.choice(tokens[tokens != tok.eos_token_id]))
                        if token == tok.eos_token_id:
                            break
                        assert backend.accept(matcher, token)
                    matchers.append(matcher)
                # Timed as decoding goes: each fill follows a token taken by every matcher (llguidance
                # keeps a matcher's mask until it moves: a repeated fill would time its cache).
                out = np.empty((a.batch, -(-a.vocab_size // 32)), dtype=np.int32)
                seconds, accepting, accepts = 0.0, 0.0, 0
                for _ in range(a.repeats):
                    t = time.perf_counter()
                    backend.fill(matchers, out)
                    seconds += time.perf_counter() - t
                    for i, matcher in enumerate(matchers):
                        tokens = allowed(out[i])
                        tokens = tokens[tokens != tok.eos_token_id]
                        if backend.terminated(matcher) or not len(tokens):  # done: the next one starts
                            matchers[i] = backend.new_matcher(compiled[i % len(compiled)])
                        else:
                            token = int(rng.choice(tokens))
                            t = time.perf_counter()
                            assert backend.accept(matcher, token)
                            accepting += time.perf_counter() - t
                            accepts += 1
                per_fill = seconds / a.repeats
                print("RESULT " + json.dumps({
                    "batch_fill": a.batch, "backend": name, "threads": threads,
                    "cpus_allowed": len(os.sched_getaffinity(0)), "ms_per_fill": round(per_fill * 1e3, 2),
                    "us_per_row": round(per_fill / a.batch * 1e6, 1),
                    "accept_us": round(accepting / max(1, accepts) * 1e6, 1)}), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
