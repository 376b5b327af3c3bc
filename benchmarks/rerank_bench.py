"""Reranking throughput: query-document pairs scored by a cross-encoder through the offline
``LLM.score`` (one call, the pairs side by side), Pagoda's or vLLM 0.26.0's, on a random-weight
model of bge-reranker-base's shape (XLM-RoBERTa, 12 layers, one label) with a word-level
tokenizer whose pair template is XLM-RoBERTa's (<s> query </s></s> document </s>):

    python -m benchmarks.rerank_bench benchmarks/configs/bge-reranker-base --engine pagoda
    PYTHONPATH=/tmp/vsite python3 -m benchmarks.rerank_bench MODEL_DIR --engine vllm

With ``--qwen3-reranker`` the model is the original Qwen3-Reranker layout instead (a
``Qwen3ForCausalLM`` config such as benchmarks/configs/qwen3-0.6b), served as vLLM serves it: the
hf_overrides of ``QWEN3_RERANKER`` (the "no" and "yes" rows of its tied head) and the score template
examples/templates/qwen3_reranker.jinja (vLLM's ``LLM.score(chat_template=...)``, Pagoda's
``chat_template`` option); the word-level tokenizer holds "no" and "yes".

Both sides take the same texts (a fresh set each round) and tokenize the pairs themselves, as a
user's call does; a ROUND line per round and a RESULT line (the last) per workload report
pairs/s and pair tokens/s, and for Pagoda the seconds of the round spent making the pairs'
prompts (``prompts_s``: rendering and tokenizing, on the host) apart from the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}.items():
    os.environ.setdefault(k, v)

# name -> (queries, documents per query, query words, document words): a RAG retriever's top 64
# passages reranked for each of 64 questions; short snippets for 256 queries
WORKLOADS = {"passages": (64, 64, (8, 32), (64, 400)), "snippets": (256, 16, (4, 16), (16, 96))}


QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}
TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "templates",
                        "qwen3_reranker.jinja")


def save_pair_tokenizer(vocab_size: int, path: str) -> None:
    """One word per id (w4 .. w{vocab-3}, then "no" and "yes") after XLM-RoBERTa's specials <s>
    <pad> </s> <unk>, and its pair template. The specials look like no word: a special named like
    one ("w1") would be cut out of the words that start with it ("w123": "w1" + an unknown "23")."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ("<s>", "<pad>", "</s>", "<unk>")
    vocab = {**{name: i for i, name in enumerate(specials)},
             **{f"w{i}": i for i in range(len(specials), vocab_size - 2)}, "no": vocab_size - 2, "yes": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
                                                       special_tokens=[("<s>", 0), ("</s>", 2)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                            cls_token="<s>", pad_token="<pad>", unk_token="<unk>").save_pretrained(path)


def pairs_of(name: str, rounds: int, vocab_size: int, seed: int = 0) -> list[tuple[list[str], list[str]]]:
    """Each round's (queries, documents) side by side, texts of random words past the specials."""
    queries, per_query, (q_lo, q_hi), (d_lo, d_hi) = WORKLOADS[name]
    rng = random.Random(seed)

    def text(lo: int, hi: int) -> str:
        return " ".join(f"w{rng.randrange(5, vocab_size - 2)}" for _ in range(rng.randint(lo, hi)))

    out = []
    for _ in range(rounds):
        firsts, seconds = [], []
        for _ in range(queries):
            query = text(q_lo, q_hi)
            firsts += [query] * per_query
            seconds += [text(d_lo, d_hi) for _ in range(per_query)]
        out.append((firsts, seconds))
    return out


def build_llm(args):
    if args.engine == "vllm":
        from vllm import LLM

        extra = {"hf_overrides": QWEN3_RERANKER} if args.qwen3_reranker else {}
        return LLM(model=args.model, runner="pooling", load_format="dummy", dtype=args.dtype,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, seed=0, gpu_memory_utilization=0.90,
                   attention_config={"backend": "FLASH_ATTN"}, **extra)
    from pagoda_daemon import LLM

    extra = {"hf_overrides": QWEN3_RERANKER, "chat_template": TEMPLATE} if args.qwen3_reranker else {}
    return LLM(args.model, load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
               max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
               gpu_memory_utilization=0.90, **extra)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a directory with config.json (weights are random); the tokenizer is made beside")
    ap.add_argument("--engine", choices=("pagoda", "vllm"), default="pagoda")
    ap.add_argument("--workloads", default="passages,snippets", help=f"comma-separated, of {sorted(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda", help="Pagoda's: cpu only to smoke-test this script")
    ap.add_argument("--qwen3-reranker", action="store_true",
                    help="serve a Qwen3ForCausalLM config as the original Qwen3-Reranker (hf_overrides, score template)")
    args = ap.parse_args(argv)
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    model_dir = f"/tmp/rerank-{os.path.basename(os.path.abspath(args.model))}"
    os.makedirs(model_dir, exist_ok=True)
    shutil.copy(os.path.join(args.model, "config.json"), model_dir)
    save_pair_tokenizer(config["vocab_size"], model_dir)
    args.model = model_dir
    started = time.perf_counter()
    llm = build_llm(args)
    init_s = time.perf_counter() - started
    version = {}
    if args.engine == "vllm":
        import vllm

        version = {"vllm": vllm.__version__}
    prompts_s = [0.0]  # Pagoda's: the round's seconds in InputProcessor.process_pairs
    if args.engine == "pagoda":
        processor = llm.engine.input_processor
        process_pairs = processor.process_pairs

        def timed_process_pairs(*a, **k):
            began = time.perf_counter()
            try:
                return process_pairs(*a, **k)
            finally:
                prompts_s[0] += time.perf_counter() - began

        processor.process_pairs = timed_process_pairs
    template = {}  # vLLM takes the score template per call, Pagoda as an engine option
    if args.engine == "vllm" and args.qwen3_reranker:
        with open(TEMPLATE) as f:
            template = {"chat_template": f.read()}
    for name in args.workloads.split(","):
        result: dict = {}
        for round_index, (firsts, seconds) in enumerate(pairs_of(name, args.rounds, config["vocab_size"])):
            prompts_s[0] = 0.0
            start = time.perf_counter()
            if args.engine == "vllm":
                outputs = llm.score(firsts, seconds, use_tqdm=False, **template)
            else:
                outputs = llm.score(firsts, seconds)
            seconds_taken = time.perf_counter() - start
            tokens = sum(len(o.prompt_token_ids) for o in outputs)
            result = {"engine": args.engine, "workload": name, "round": round_index, "seconds": round(seconds_taken, 3),
                      "pairs": len(outputs), "pair_tokens": tokens, "pairs_s": round(len(outputs) / seconds_taken, 1),
                      "pair_tok_s": round(tokens / seconds_taken, 1), "dtype": args.dtype, "init_s": round(init_s, 1),
                      "model": os.path.basename(model_dir),
                      **({"prompts_s": round(prompts_s[0], 3)} if args.engine == "pagoda" else {}),
                      **({"layout": "qwen3-reranker"} if args.qwen3_reranker else {}), **version}
            print("ROUND", json.dumps(result), flush=True)
        print("RESULT", json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
