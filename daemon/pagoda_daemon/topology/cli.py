"""`pagoda topology`: print the node's topology, a pinning plan, or publish a NodeTopology."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from pagoda_daemon.topology.discover import discover
from pagoda_daemon.topology.gpus import BACKENDS
from pagoda_daemon.topology.pinning import parse_policy, plan_pinning
from pagoda_daemon.topology.render import render


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagoda topology",
        description="Show this node's CPU/NUMA/GPU/NIC topology, plan CPU pinning, or publish a NodeTopology.",
    )
    parser.add_argument("--sysfs-root", default="/", metavar="DIR", help="read sysfs below DIR (default /)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument("--gpu-backend", choices=BACKENDS, default="auto", help="where GPU facts come from")
    parser.add_argument("--plan", action="store_true", help="print the CPU pinning plan for the visible GPUs")
    parser.add_argument(
        "--policy", default="auto", help="pinning policy for --plan: auto, none or cpus=<list>"
    )
    agent = parser.add_argument_group("agent mode")
    agent.add_argument("--publish", action="store_true", help="write the NodeTopology object (NODE_NAME)")
    agent.add_argument("--once", action="store_true", help="with --publish: write once and exit")
    agent.add_argument(
        "--interval", type=float, default=60.0, metavar="SECONDS", help="rediscover and heartbeat period"
    )
    agent.add_argument("--node-name", help="object name (default: $NODE_NAME)")
    agent.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    agent.add_argument("--model-cache", metavar="DIR",
                       help="with --publish: the node's model cache (one directory per namespace) to evict "
                            "from and report in the NodeTopology status")
    agent.add_argument("--model-cache-max-gib", type=float, default=200.0, metavar="GIB",
                       help="evict the least recently used models nobody serves above this size (default 200)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for `pagoda topology ARGS...` and `python -m pagoda_daemon.topology`."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help, or a usage error already printed
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.publish else logging.ERROR, format="%(levelname)s %(message)s"
    )
    if args.interval <= 0:
        parser.print_usage(sys.stderr)
        print("pagoda topology: error: --interval must be positive", file=sys.stderr)
        return 2
    if not (0 < args.model_cache_max_gib <= 2**20):  # NaN fails too
        print("pagoda topology: error: --model-cache-max-gib must be in (0, 1048576]", file=sys.stderr)
        return 2
    if args.model_cache and not args.publish:
        print("pagoda topology: error: --model-cache only makes sense with --publish", file=sys.stderr)
        return 2
    if args.once and not args.publish:
        print("pagoda topology: error: --once only makes sense with --publish", file=sys.stderr)
        return 2
    if args.publish:
        return _publish(args)

    report = discover(args.sysfs_root, gpu_backend=args.gpu_backend)
    if args.plan:
        try:
            plan = plan_pinning(
                report, report.visibility.visible_gpus, report.allowed_cpus, parse_policy(args.policy)
            )
        except ValueError as exc:
            print(f"pagoda topology: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(plan.to_dict(), indent=2) if args.json else "\n".join(plan.describe()))
    elif args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render(report))
    return 0


def _publish(args: argparse.Namespace) -> int:
    from pagoda_daemon.topology.publish import (
        ModelCacheKeeper,
        Publisher,
        connect,
        node_name_from_env,
        run_agent,
    )

    try:
        node = node_name_from_env(args.node_name)
        api = connect(args.kubeconfig)
    except (ValueError, RuntimeError) as exc:
        print(f"pagoda topology: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    keeper = (ModelCacheKeeper(api, args.model_cache, int(args.model_cache_max_gib * 2**30))
              if args.model_cache else None)
    return run_agent(
        Publisher(api, node, status_extra=keeper),
        lambda: discover(args.sysfs_root, gpu_backend=args.gpu_backend),
        args.interval,
        once=args.once,
        stop=stop,
    )
