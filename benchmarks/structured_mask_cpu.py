"""Mask-fill time per token of the structured-outputs benchmark's schemas, on the CPU alone (no
model, no GPU): where the engine's grammar costs go, checkable on any machine.

    python -m benchmarks.structured_mask_cpu [--tokenizer DIR] [--variants engine,class-only,xgrammar]

For each schema (benchmarks/structured_schemas.py) and each grammar variant, one matcher walks
an output drawn uniformly among the allowed tokens (what random weights sample), and the time of
each fill_next_token_bitmask is summed. Variants:

  engine      pagoda_daemon.structured_outputs.build_grammar, as the engine compiles it
  class-only  the same, with length-bounded strings' characters as one character class (no
              escape alternative): benchmarks/structured_outputs.py --strings class-only
  xgrammar    xgrammar's own from_json_schema(any_whitespace=True), as vLLM 0.26 builds it
              (no whitespace bound, no string fixes)

Without --tokenizer the synthetic Qwen3-size tokenizer is built (a few seconds).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--variants", default="engine,class-only,xgrammar")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--vocab-size", type=int, default=151936)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import numpy as np
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from benchmarks.structured_outputs import CLASS_ONLY_STRING_CHAR
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
    engine_char = so._JSON_STRING_CHAR

    def grammar(variant: str, schema: dict):
        if variant == "xgrammar":
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True)
        so._JSON_STRING_CHAR = CLASS_ONLY_STRING_CHAR if variant == "class-only" else engine_char
        try:
            return so.build_grammar(so.StructuredOutputsParams(json=schema))
        finally:
            so._JSON_STRING_CHAR = engine_char

    for variant in a.variants.split(","):
        for si, schema in enumerate(SCHEMAS):
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
                bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:a.vocab_size]
                token = int(rng.choice(np.flatnonzero(bits)))
                assert matcher.accept_token(token)
                out.append(token)
            done = matcher.is_terminated()
            err = validate(tok.decode(out, skip_special_tokens=True), si) if done else "unfinished"
            print("RESULT " + json.dumps({
                "variant": variant, "schema": schema["title"], "compile_s": round(compile_s, 3), "tokens": len(out),
                "fill_us_per_token": round(fill / len(out) * 1e6, 1), "finished": done, "valid": err is None,
                **({"why": err[:120]} if err else {})}), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
