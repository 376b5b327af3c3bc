"""The `pagoda` command. Subcommands import their machinery lazily, so `pagoda topology`
and `pagoda operator` never import torch."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pagoda_daemon.logs import FORMATS
from pagoda_daemon.logs import configure as configure_logging
from pagoda_daemon.options import EXIT_REFUSED

DEFAULT_PROMPTS = ["The capital of France is", "Paged attention means"]


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, generated from EngineConfig's declarations."""
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.options import add_cli_args

    add_cli_args(p.add_argument_group("engine"), EngineConfig)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig's keyword arguments from parsed flags."""
    from pagoda_daemon.config import EngineConfig
    from pagoda_daemon.options import values_from_args

    return values_from_args(args, EngineConfig)


def tiny_model_dir(arch: str) -> Path:
    from pagoda_daemon.models.tiny import build_tiny_model

    root = Path(os.environ.get("PAGODA_CACHE", Path.home() / ".cache" / "pagoda")) / "tiny-models" / arch
    if not (root / "config.json").is_file():
        print(f"building a tiny random {arch} model in {root} ...", file=sys.stderr)
        build_tiny_model(arch, root)
    return root


def cmd_generate(args: argparse.Namespace) -> int:
    from pagoda_daemon import LLM, SamplingParams

    if (args.model is None) == (args.tiny is None):
        print("pagoda generate: give a MODEL_DIR or --tiny ARCH (not both)", file=sys.stderr)
        return EXIT_REFUSED
    model = str(tiny_model_dir(args.tiny)) if args.tiny else args.model
    prompts = args.prompt or DEFAULT_PROMPTS
    try:
        llm = LLM(model, **engine_kwargs(args))
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
            seed=args.sampling_seed, ignore_eos=args.ignore_eos,
        )
        outputs = llm.generate(prompts, params)
    except ValueError as e:
        print(f"pagoda generate: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if args.tiny:
        print(f"(a tiny {args.tiny} with random weights from {model}: the text is noise by design)")
    for out in outputs:
        c = out.outputs[0]
        print(f"prompt: {out.prompt!r}\n  -> {c.text!r}\n     ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    stats = llm.get_stats()
    print(
        f"engine: {stats.num_steps} steps, {stats.num_preemptions} preemptions, "
        f"prefix-cache hit rate {stats.prefix_cache.hit_rate:.0%}, {stats.num_kv_blocks} KV blocks"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="Pagoda: LLM serving on Kubernetes.")
    parser.add_argument("--log-level", default=None,
                        help="DEBUG, INFO, WARNING, ... (default: INFO for serve, WARNING otherwise)")
    parser.add_argument("--log-format", choices=FORMATS, default=None,
                        help="text (default), or json: one object per line (also $PAGODA_LOG_FORMAT)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="offline generation with the engine (no server)")
    gen.add_argument("model", nargs="?", help="a Hugging Face-format model directory")
    gen.add_argument("--tiny", choices=["llama", "qwen3", "qwen3_moe"], help="build and use a tiny random model")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API (engine in its own process)")
    from pagoda_daemon.server.serve import add_serve_args

    add_serve_args(serve)
    serve.set_defaults(func=None)

    demo = sub.add_parser("demo", help="serve a tiny model on loopback and ask it through the openai client")
    demo.add_argument("--arch", choices=["llama", "qwen3", "qwen3_moe"], default="llama")
    demo.add_argument("--question", default="What is paged attention?")
    demo.set_defaults(func=lambda a: __import__("pagoda_daemon.demo", fromlist=["run_demo"]).run_demo(a.arch, a.question))

    pd = sub.add_parser("pd-proxy", help="prefill/decode disaggregation: route each completion to a prefill "
                        "then a decode instance")
    from pagoda_daemon.server import pd_proxy

    pd_proxy.add_args(pd)
    pd.set_defaults(func=pd_proxy.run)

    topo = sub.add_parser("topology", help="node topology report and NodeTopology agent", add_help=False)
    topo.set_defaults(func=None, delegate="pagoda_daemon.topology.cli")
    op = sub.add_parser("operator", help="run the Kubernetes operator", add_help=False)
    op.set_defaults(func=None, delegate="pagoda_operator.cli")
    bench = sub.add_parser("bench", help="serving benchmark of any OpenAI-compatible endpoint (serve, sweep)",
                           add_help=False)
    bench.set_defaults(func=None, delegate="pagoda_daemon.bench.cli")
    return parser


DELEGATED = ("topology", "operator", "bench")
_GLOBAL_OPTIONS = ("--log-level", "--log-format")  # the options before the subcommand that take a value


def _subcommand_index(argv: list[str]) -> int | None:
    """Where the subcommand's name is: the first argument that is not a global option or its value."""
    i = 0
    while i < len(argv):
        if argv[i] in _GLOBAL_OPTIONS:
            i += 2
        elif argv[i].startswith(tuple(o + "=" for o in _GLOBAL_OPTIONS)):
            i += 1
        else:
            return None if argv[i].startswith("-") else i
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    # Delegated subcommands own their flags: pass everything after the name through. The name is
    # the subcommand only in the subcommand's place (`pagoda serve m --served-model-name bench` is
    # a serve).
    i = _subcommand_index(argv)
    if i is not None and argv[i] in DELEGATED:
        head = parser.parse_args(argv[: i + 1])
        logging.basicConfig(level=(head.log_level or "WARNING").upper())
        import importlib

        return importlib.import_module(head.delegate).main(argv[i + 1 :])
    args = parser.parse_args(argv)
    # Serving says what it does (start-up phases, a line per request) as vLLM does at INFO.
    args.log_level = (args.log_level or ("INFO" if args.command == "serve" else "WARNING")).upper()
    try:
        configure_logging(args.log_level, "api" if args.command == "serve" else "", args.log_format)
    except ValueError as e:  # a bad level or $PAGODA_LOG_FORMAT
        print(f"pagoda: {e}", file=sys.stderr)
        return EXIT_REFUSED
    if args.command == "serve":
        from pagoda_daemon.server.serve import run_serve

        return run_serve(args, _explicit_options(argv))
    return args.func(args)


def _explicit_options(argv: list[str]) -> set[str]:
    """The option names given on the command line (so a --config file does not override them)."""
    names = set()
    for token in argv:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0]
            names.add(name.removeprefix("no-").replace("-", "_"))
    return names


if __name__ == "__main__":
    sys.exit(main())
