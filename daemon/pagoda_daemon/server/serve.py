"""`pagoda serve MODEL_DIR`: the daemon that runs in every Pagoda pod."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING

# Only the standard library and stdlib-only modules here: `pagoda operator` builds this
# command's flags too, in an image without the server's packages (uvicorn, fastapi, zmq).
from pagoda_daemon import capabilities
from pagoda_daemon.config import EngineConfig
from pagoda_daemon.model_uri import is_uri
from pagoda_daemon.options import EXIT_REFUSED, check_value, declared, refusal_message, values_from_args
from pagoda_daemon.server.auth import (
    ADMIN_API_KEY_ENV,
    ADMIN_PATHS,
    API_KEY_ENV,
    DEFAULT_EXEMPT_PATHS,
    APIKeys,
    split_list,
)
from pagoda_daemon.server.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_WAITING_REQUESTS,
    ConnectionLimits,
    RequestLimits,
)
from pagoda_daemon.server.reasoning import REASONING_PARSERS
from pagoda_daemon.server.tool_parsers import PARSERS as TOOL_PARSERS

if TYPE_CHECKING:
    from pagoda_daemon.models.fetch import FetchProgress
    from pagoda_daemon.server.http_protocol import DrainingServer

log = logging.getLogger("pagoda.serve")

SHUTDOWN_GRACE_S = 3  # after the drain: for responses already ended to reach their clients

def add_serve_args(p: argparse.ArgumentParser) -> None:
    from pagoda_daemon.cli import add_engine_args

    p.add_argument("model", help="a Hugging Face-format model directory, hf://org/name[@revision] or "
                                 "s3://bucket/prefix (fetched into --model-cache-dir first)")
    p.add_argument("--config", help="YAML/JSON file of options (snake_case names); flags override it")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="model name clients use (default: the model directory's name)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="queued requests beyond the running batch before new ones get 503")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    p.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between engine-stats log lines while the engine works (0: none)")
    p.add_argument("--disable-log-stats", action="store_true", help="no engine-stats log lines (vLLM's flag)")
    p.add_argument("--node-rank-from-hostname", action="store_true",
                   help="--node-rank is 1 + the StatefulSet ordinal that ends the hostname (a worker pod of "
                        "a group the operator renders)")
    p.add_argument("--node-ready-port", type=int, default=0,
                   help="with --node-rank above 0: accept connections on this port once this node's ranks are "
                        "up (a tcpSocket readiness probe; 0: none)")
    p.add_argument("--ready-timeout", type=float, default=1800.0, help="seconds the engine may take to start")
    p.add_argument("--otlp-traces-endpoint", default=None, help="OTLP/HTTP traces endpoint (or OTEL_* variables)")
    p.add_argument("--kv-events-endpoint", nargs="?", const="", default=None,
                   help="ZMQ PUB endpoint for KV events (alone: the default loopback endpoint, docs/kv-events.md; "
                        "a bare port binds loopback; all interfaces only as tcp://*:PORT)")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (comma-separated for several; or {API_KEY_ENV})")
    p.add_argument("--admin-api-key", default=None,
                   help="the key of the admin routes (elastic EP resizes; docs/elastic-ep.md), never a user's API key "
                        f"(or {ADMIN_API_KEY_ENV}; unset: the admin routes answer 403)")
    p.add_argument("--auth-exempt-paths", default=",".join(DEFAULT_EXEMPT_PATHS),
                   help="comma-separated paths answered without a key ('' for none)")
    p.add_argument("--enable-fastapi-docs", action="store_true",
                   help="serve /docs, /redoc and /openapi.json (off: they map the API for anyone)")
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how the model writes tool calls: hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3), "
                        "llama3_json (Llama 3.x); default: the format the model's chat template shows")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM command lines: tool_choice auto is on whenever the model's tool call "
                        "format is known")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="return the model's thinking (<think>...</think>) as reasoning_content: qwen3, deepseek_r1")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413")
    p.add_argument("--header-read-timeout", type=float, default=ConnectionLimits.header_timeout_s,
                   help="seconds a client has to send a request's headers")
    p.add_argument("--body-read-timeout", type=float, default=ConnectionLimits.body_timeout_s,
                   help="seconds a client has to send a request's body, once its headers are in")
    p.add_argument("--max-connections", type=int, default=ConnectionLimits.max_connections,
                   help="open HTTP connections beyond this get 503 and are closed")
    add_engine_args(p)


def resolve_options(args: argparse.Namespace, explicit: set[str]) -> dict:
    """CLI flags over the --config file over defaults."""
    options = vars(args).copy()
    if args.config:
        import yaml

        try:
            loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read --config {args.config}: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {args.config} must hold a mapping of option names to values")
        unknown = sorted(str(k) for k in loaded if k not in options)
        if unknown:
            raise ValueError(f"--config {args.config} has unknown options {unknown}")
        engine_options = {d.name: d for d in declared(EngineConfig)}
        for key, value in loaded.items():
            if key in engine_options:
                value = check_value(engine_options[key], value, f"--config {args.config}")
            if key not in explicit:
                options[key] = value
    if options["node_rank_from_hostname"]:
        options["node_rank"] = node_rank_from_hostname(socket.gethostname())
    refused = refusal_message(options, EngineConfig)
    if refused:
        raise ValueError(refused)
    for key in ("max_request_body_bytes", "header_read_timeout", "body_read_timeout", "max_connections"):
        if not options[key] > 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, not {options[key]}")
    if not 0 <= options["node_ready_port"] <= 65535:
        raise ValueError(f"--node-ready-port must be 0 to 65535, not {options['node_ready_port']}")
    interval = options["log_stats_interval"]
    if not (isinstance(interval, (int, float)) and 0 <= interval <= 86400):  # NaN fails both comparisons
        raise ValueError(f"--log-stats-interval must be 0 to 86400 seconds, not {interval}")
    for key, known in (("tool_call_parser", TOOL_PARSERS), ("reasoning_parser", REASONING_PARSERS)):
        if options[key] is not None and options[key] not in known:  # a --config file skips argparse's choices
            raise ValueError(f"--{key.replace('_', '-')} must be one of {sorted(known)}, not {options[key]!r}")
    if options["kv_events_endpoint"] is not None:  # a --config file may give the port as a number
        from pagoda_daemon.telemetry.kv_events import DEFAULT_ENDPOINT

        options["kv_events_endpoint"] = str(options["kv_events_endpoint"]) or DEFAULT_ENDPOINT
    if is_uri(str(options["model"])):
        if not capabilities.supported("model_uri"):
            raise ValueError(f"model {options['model']!r}: {capabilities.refusal('model_uri')}")
        from pagoda_daemon.models.fetch import check_reference

        check_reference(str(options["model"]))  # malformed, unknown scheme or pvc://: exit 2 before any fetch
    return options


def _served_name_of(reference: str) -> str:
    """The name clients use for a fetched model: the repository id (as vLLM), or the prefix's last part."""
    from pagoda_daemon.model_uri import parse

    uri = parse(reference)
    if uri.scheme == "hf":
        return uri.location
    return uri.path.rsplit("/", 1)[-1] if uri.path else uri.location


class _ProgressLog:
    """Fetch progress in the log: at most one line every 10 s, and the first and last file."""

    def __init__(self) -> None:
        self.last = 0.0

    def __call__(self, p) -> None:
        now = time.monotonic()
        if p.files_done not in (0, p.files_total) and now - self.last < 10:
            return
        self.last = now
        eta = f", about {p.eta_s:.0f} s left" if p.eta_s is not None and p.files_done < p.files_total else ""
        log.info("downloading model: %d/%d files, %.1f/%.1f MB, %.1f MB/s%s", p.files_done, p.files_total,
                 p.bytes_done / 1e6, p.bytes_total / 1e6, p.rate_bytes_per_s / 1e6, eta)


def node_rank_from_hostname(hostname: str) -> int:
    """``group-0-2`` (the StatefulSet of group 0's workers, ordinal 2) is node 3: node 0 is the leader."""
    head, _, ordinal = hostname.rpartition("-")
    if not head or not ordinal.isdigit():
        raise ValueError(f"--node-rank-from-hostname: hostname {hostname!r} does not end in -<ordinal>")
    return int(ordinal) + 1


def _fetch_and_hold(reference: str, cache_dir: str | None,
                    progress: Callable[[FetchProgress], None]) -> tuple[str, IO[str]]:
    """The fetched model's directory and the shared lock that keeps it from eviction; fetched
    again when the node agent evicted it between the fetch and the lock."""
    from pagoda_daemon.models.fetch import ModelFetchError, resolve_model
    from pagoda_daemon.models.model_cache import hold

    for _ in range(3):
        path = resolve_model(reference, cache_dir, on_progress=progress)
        lease = hold(path)
        if lease is not None:
            return path, lease
    raise ModelFetchError(f"{reference}: evicted from the node's cache as soon as it was fetched, three times")


def run_serve(args: argparse.Namespace, explicit: set[str]) -> int:
    try:
        options = resolve_options(args, explicit)
    except ValueError as e:
        print(f"pagoda serve: {e}", file=sys.stderr)
        return EXIT_REFUSED
    reference = str(options["model"])
    if is_uri(reference):  # fetched into the node's cache before anything starts; then a local directory
        from pagoda_daemon.models.fetch import ModelFetchError
        from pagoda_daemon.server.download_status import DownloadStatus

        status = DownloadStatus(options["host"], options["port"])
        log_progress = _ProgressLog()

        def progress(p: FetchProgress) -> None:
            status.update(p)
            log_progress(p)

        try:  # node 0 answers the probes on its API port meanwhile (a big model outlasts a startup probe)
            with status if options["node_rank"] == 0 else contextlib.nullcontext():
                # held (a shared lock) until this process ends: the node agent evicts only what nobody holds
                options["model"], _model_lease = _fetch_and_hold(reference, options["model_cache_dir"], progress)
        except (ModelFetchError, OSError) as e:
            print(f"pagoda serve: cannot fetch the model: {e}", file=sys.stderr)
            return 1
        if not options["served_model_name"]:
            options["served_model_name"] = _served_name_of(reference)
    try:
        config = EngineConfig(model=options["model"], enable_kv_events=bool(options["kv_events_endpoint"]),
                              **values_from_args(options, EngineConfig))
        from pagoda_daemon.distributed.layout import check_layout
        from pagoda_daemon.models.loader import engine_model_config, load_engine_model

        # a bad path, architecture, override, tokenizer or template fails here; a worker pod of a
        # group (node_rank > 0) serves no API, so it loads no tokenizer and renders no template
        model = load_engine_model(config) if config.node_rank == 0 else None
        model_config = model.config if model is not None else engine_model_config(config)
        check_layout(model_config, config.tensor_parallel_size, config.expert_parallel_size, config.enable_eplb,
                     config.num_redundant_experts, config.elastic_ep_max_size, config.data_experts_engines)
        _keys(options)
        from pagoda_daemon.kv_offload import tiered
        from pagoda_daemon.kv_offload.transfer_auth import SourceHeaders

        tiered.check_options(config)  # the engine checks them again; a refusal here is one line
        if config.data_parallel_size > 1:
            _check_data_parallel(config, options["kv_events_endpoint"])
        kv_source_headers = SourceHeaders.from_config(config)
        from pagoda_daemon.pooling import engine_pooling

        pooling = engine_pooling(config, model_config)  # None: the model generates
        name = options["served_model_name"] or Path(options["model"]).resolve().name
        adapters = None
        if config.enable_lora and config.node_rank == 0:  # each read and checked against the model now
            from pagoda_daemon.lora.registry import AdapterRegistry

            adapters = AdapterRegistry.from_modules(config.lora_modules, model_config, config.max_lora_rank, name,
                                                    config.model_cache_dir)
    except ValueError as e:
        print(f"pagoda serve: {e}", file=sys.stderr)
        return EXIT_REFUSED
    from pagoda_daemon.models.registry import max_positions

    max_len = config.max_model_len or max_positions(model_config) or 32768
    if config.node_rank > 0:  # a worker pod of a group: its ranks only, no API server
        from pagoda_daemon.executor.multiproc import run_node

        return run_node(config, model_config, max_len, options["node_ready_port"])
    return asyncio.run(_serve(config, model, options, name, args.log_level.upper(), max_len, pooling,
                              kv_source_headers, adapters))


def _check_data_parallel(config: EngineConfig, kv_events_endpoint: str | None) -> None:
    """Enough GPUs for every engine, and a KV-events address for each (ValueError)."""
    import torch

    needed = config.data_parallel_size * config.world_size
    if config.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < needed:
        raise ValueError(f"data_parallel_size {config.data_parallel_size} × {config.world_size} ranks need {needed} "
                         f"GPUs; this process sees {torch.cuda.device_count()}")
    if kv_events_endpoint:
        from pagoda_daemon.telemetry.kv_events import offset_endpoint

        offset_endpoint(kv_events_endpoint, config.data_parallel_size - 1)


def _keys(options: dict) -> tuple[APIKeys, APIKeys]:
    """(the users' keys, the admin key). The admin routes check the admin key themselves
    (server/admin.py) and never take a user's, so the users' check lets them through; an admin
    key that is also a user key is refused."""
    keys = APIKeys.from_options(options["api_key"], os.environ,
                                [*split_list(options["auth_exempt_paths"]), *ADMIN_PATHS])
    admin_keys = APIKeys.from_options(options["admin_api_key"], os.environ, (), env=ADMIN_API_KEY_ENV)
    if set(admin_keys.keys) & set(keys.keys):
        raise ValueError("the admin API key must differ from every user API key")
    return keys, admin_keys


async def _serve(config, model, options: dict, served_name: str, log_level: str, max_model_len: int,
                 pooling=None, kv_source_headers=None, adapters=None) -> int:
    import uvicorn

    from pagoda_daemon.server.api import ServerSettings, build_app
    from pagoda_daemon.server.engine_client import EngineClient, EngineDeadError
    from pagoda_daemon.server.http_protocol import DrainingServer, GuardedH11Protocol

    keys, admin_keys = _keys(options)
    if not keys.enabled:
        log.warning("the API is unauthenticated: anyone who reaches port %d can use it (set --api-key or %s)",
                    options["port"], API_KEY_ENV)
    metrics = _make_metrics(served_name, max_model_len, config.max_num_batched_tokens)
    if metrics is not None:
        from pagoda_daemon.models.fetch import fetched_from

        source = fetched_from(config.model)  # None unless the model directory is a fetched one
        if source is not None:
            metrics.set_model_source(*source)
    tracer = _make_tracer(options.get("otlp_traces_endpoint"))
    client = EngineClient(config, metrics=metrics, log_level=log_level,
                          stats_log_interval=0.0 if options["disable_log_stats"] else options["log_stats_interval"],
                          kv_events_endpoint=options.get("kv_events_endpoint"), model=model)
    settings = ServerSettings(served_name, options["max_waiting_requests"], tool_call_parser=options["tool_call_parser"],
                              reasoning_parser=options["reasoning_parser"], kv_source_headers=kv_source_headers,
                              adapters=adapters, pooling=pooling)
    app = build_app(client, settings, tracer, keys=keys, admin_keys=admin_keys,
                    limits=RequestLimits(options["max_request_body_bytes"]), api_docs=options["enable_fastapi_docs"])
    await client.start()
    waiter = asyncio.create_task(client.wait_ready(options["ready_timeout"]))
    from pagoda_daemon.topology.publish import publish_at_start

    topology_task = asyncio.create_task(asyncio.to_thread(publish_at_start))  # only with NODE_NAME set
    limits = ConnectionLimits(options["header_read_timeout"], options["body_read_timeout"], options["max_connections"])
    server = DrainingServer(uvicorn.Config(
        app, host=options["host"], port=options["port"], log_level=log_level.lower(),
        http=functools.partial(GuardedH11Protocol, limits=limits),  # type: ignore[arg-type]
        ws="none", server_header=False,  # no WebSocket routes to upgrade to; no version banner
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S, access_log=False,  # the RequestGuard logs each request
        log_config=None,  # uvicorn's lines go through this process's handler (text or json)
    ))
    serving = asyncio.create_task(server.serve())
    stop = asyncio.create_task(server.stop_requested.wait())
    try:
        await asyncio.wait({waiter, serving, stop}, return_when=asyncio.FIRST_COMPLETED)
        if waiter.done() and waiter.exception() is not None:
            log.error("engine failed to start: %s", waiter.exception())
            server.should_exit = True
            await serving
            return 1
        if waiter.done():
            from pagoda_daemon.heap import freeze_startup_heap

            freeze_startup_heap()  # the app, the tokenizer, the modules: as long-lived as the process
            log.info("serving %s on http://%s:%d", served_name, options["host"], options["port"])
        return await _serve_until_stopped(server, serving, client, options["drain_timeout"])
    finally:
        stop.cancel()
        topology_task.cancel()
        waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError, EngineDeadError, TimeoutError):
            await waiter  # its failure, if any, was logged above
        await client.shutdown()
        if tracer is not None:
            tracer.shutdown()


async def _serve_until_stopped(server: DrainingServer, serving: asyncio.Task, client, drain_timeout_s: float) -> int:
    """Serve until SIGTERM (drain, exit 0) or the engine's death (exit 1: the kubelet
    restarts the pod; the in-flight requests have their errors by then)."""
    dead = asyncio.create_task(client.wait_dead())
    stop = asyncio.create_task(server.stop_requested.wait())
    try:
        done, _ = await asyncio.wait({serving, dead, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop in done and dead not in done:
            log.info("stopping: draining for up to %g s; new requests get 503", drain_timeout_s)
            drain = asyncio.create_task(client.drain(drain_timeout_s))
            await asyncio.wait({drain, serving}, return_when=asyncio.FIRST_COMPLETED)  # a second ^C ends it
            drain.cancel()
        elif dead in done:
            log.error("the engine is dead: the daemon exits so that it is restarted")
        server.should_exit = True
        await serving
        return 1 if client.dead_reason is not None else 0
    finally:
        dead.cancel()
        stop.cancel()


def _make_metrics(served_name: str, max_model_len: int, max_num_batched_tokens: int):
    try:
        from pagoda_daemon.telemetry.metrics import EngineMetrics
    except ImportError:  # prometheus-client missing: /metrics answers empty
        log.warning("prometheus-client is not installed: /metrics is empty")
        return None
    return EngineMetrics(served_name, max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens)


def _make_tracer(endpoint: str | None):
    try:
        from pagoda_daemon.telemetry.tracing import RequestTracer
    except ImportError:
        if endpoint:
            raise
        return None
    return RequestTracer.from_config(endpoint)
