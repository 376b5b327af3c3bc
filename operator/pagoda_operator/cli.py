"""``pagoda operator`` / ``python -m pagoda_operator``: run the InferenceService operator.

Standalone, all namespaces unless ``--namespace`` is given (repeatable). With leader election on
(the default) the process first waits for the Lease, then runs kopf; losing the lease stops kopf
and exits 1 so that the pod restarts and queues for the lease again. The admission webhook
(``--admission-port``) serves from start-up on every replica, leading or not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import posixpath
import ssl
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from pagoda_operator import builders, elastic, leader_worker_set, model_config, telemetry
from pagoda_operator.admission import Policy, image_repository, path_within, system_path

if TYPE_CHECKING:
    from pagoda_operator.kube import Kube
    from pagoda_operator.webhook import AdmissionWebhook


def endpoint_url(value: str) -> str:
    """An http(s) URL with a host and no user information (or ``none``), for argparse."""
    from pagoda_operator.spec import endpoint_error

    why = None if value == "none" else endpoint_error(value)
    if why:
        raise argparse.ArgumentTypeError(why)
    return value.rstrip("/")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pagoda operator", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then $KUBECONFIG)"
    )
    p.add_argument(
        "--daemon-image",
        default=os.environ.get("PAGODA_DAEMON_IMAGE", builders.DEFAULT_IMAGE),
        help="daemon image for InferenceServices that set no spec.image",
    )
    p.add_argument("--image-pull-policy", default="IfNotPresent", choices=["Always", "IfNotPresent", "Never"])
    p.add_argument(
        "--node-model-cache",
        default="",
        type=host_directory,
        metavar="HOST_PATH",
        help="the nodes' model cache (chart modelCache.nodePath): hf:// and s3:// models are fetched "
        "there once per node, one directory per namespace; default: into each pod's cache volume",
    )
    p.add_argument(
        "--interval",
        type=bounded(float, 0.1, 86400),
        default=15.0,
        help="seconds between autoscaler steps and resyncs of each InferenceService",
    )
    p.add_argument("--scrape-timeout", type=bounded(float, 0.1, 600), default=2.0, help="seconds to wait for a pod's /metrics")
    p.add_argument(
        "--model-config-endpoint", action="append", default=None, metavar="URL", type=endpoint_url,
        help="a Hugging Face Hub-compatible endpoint whose hf:// models' config.json the operator may read "
        f"(anonymously, no Secret) to refuse at apply time a parallel layout the model cannot take; repeat "
        f"for more; default {model_config.DEFAULT_ENDPOINT}; 'none': read none (docs/security.md)",
    )
    p.add_argument(
        "--metrics-port", type=int, default=8080, help="operator /metrics (and /healthz); 0 disables"
    )
    p.add_argument("--metrics-address", default="0.0.0.0")
    p.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="kopf liveness endpoint, e.g. http://0.0.0.0:8081/healthz",
    )
    p.add_argument("--workers", type=bounded(int, 1, 256), default=8, help="threads running reconcile passes")
    p.add_argument(
        "--lws-discovery-interval",
        type=bounded(float, 0.1, 86400),
        default=leader_worker_set.RECHECK_S,
        help="seconds between API discovery checks of whether LeaderWorkerSets are served (where they are, "
        "podsPerReplica > 1 renders one per InferenceService instead of StatefulSets)",
    )
    netpol = p.add_argument_group("network policy")
    netpol.add_argument(
        "--network-policy",
        action="store_true",
        help="give each InferenceService a NetworkPolicy: its HTTP port open to --network-policy-http-from, "
        "every other port of its pods closed",
    )
    netpol.add_argument(
        "--network-policy-http-from",
        action="append",
        type=network_policy_peer,
        default=[],
        metavar="JSON",
        help='a NetworkPolicyPeer allowed to the HTTP port, e.g. \'{"namespaceSelector": {"matchLabels": '
        '{"team": "a"}}}\' (repeatable); default: every namespace',
    )
    le = p.add_argument_group("leader election")
    le.add_argument("--leader-elect", dest="leader_elect", action="store_true", default=True)
    le.add_argument(
        "--no-leader-elect",
        dest="leader_elect",
        action="store_false",
        help="act without a lease (only safe with exactly one replica)",
    )
    le.add_argument(
        "--lease-namespace",
        default=None,
        help="namespace of the Lease (default: $POD_NAMESPACE, else 'default')",
    )
    le.add_argument("--lease-name", default="pagoda-operator")
    le.add_argument("--lease-duration", type=bounded(int, 2, 3600), default=15, help="seconds")
    le.add_argument(
        "--lease-renew", type=bounded(float, 0.1, 3600), default=None, help="seconds between renewals (default duration/3)"
    )
    le.add_argument(
        "--lease-grace",
        type=bounded(float, 1, 86400),
        default=60.0,
        help="seconds the leader keeps leading while the API server cannot be reached (at least the "
        "lease duration; docs/operator.md, Leader election)",
    )
    adm = p.add_argument_group("admission webhook (docs/operator.md, Admission)")
    adm.add_argument(
        "--admission-port",
        type=int,
        default=0,
        help="HTTPS port of the validating webhook; 0 (default) disables",
    )
    adm.add_argument("--admission-address", default="0.0.0.0")
    adm.add_argument(
        "--admission-cert-file", default=None, help="PEM server certificate (chain) of the webhook"
    )
    adm.add_argument("--admission-key-file", default=None, help="PEM private key of the webhook")
    adm.add_argument(
        "--admission-client-ca",
        default=None,
        metavar="FILE",
        help="PEM CA bundle: only clients with a certificate it signed (the API server's webhook client "
        "certificate) are answered; default: any client",
    )
    adm.add_argument(
        "--admission-policy",
        default=None,
        metavar="YAML",
        help="the allowlists as a YAML or JSON mapping (the chart's admission.policy values); "
        "default: built-in defaults. The --daemon-image repository is always allowed",
    )
    p.add_argument(
        "--log-level",
        default=os.environ.get("PAGODA_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
    )
    return p


def admission_policy(args: argparse.Namespace) -> Policy:
    """The webhook's policy: ``--admission-policy``, plus the daemon image's repository."""
    values = yaml.safe_load(args.admission_policy or "") or {}
    if not isinstance(values, dict):
        raise ValueError(f"expected a mapping of allowlists, got {args.admission_policy!r}")
    return Policy.from_values(values, extra_images=(image_repository(args.daemon_image),),
                              reserved_host_paths=(args.node_model_cache,) if args.node_model_cache else ())


def start_admission_webhook(args: argparse.Namespace, policy: Policy, kube: Kube) -> AdmissionWebhook:
    """Serve the validating webhook in a thread (every replica, before leader election)."""
    import kopf

    from pagoda_operator.webhook import AdmissionWebhook

    server = kopf.WebhookServer(
        addr=args.admission_address,
        port=args.admission_port,
        certfile=args.admission_cert_file,
        pkeyfile=args.admission_key_file,
        verify_cafile=args.admission_client_ca,
        verify_mode=ssl.CERT_REQUIRED if args.admission_client_ca else None,
    )
    webhook = AdmissionWebhook(
        server,
        policy,
        lambda user, namespace, access: kube.user_can(
            user, access.verb, access.resource, namespace, access.name
        ),
    )
    webhook.start()
    logging.getLogger("pagoda_operator").info(
        "admission webhook on https://%s:%d, images allowed: %s",
        args.admission_address,
        args.admission_port,
        ", ".join(policy.images),
    )
    return webhook


def bounded(cast: Callable[[str], float], low: float, high: float) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``cast`` within [low, high]."""

    def parse(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is outside [{low:g}, {high:g}]")
        return value

    return parse


# Below /var/lib (where node state belongs), the directories of the node's own daemons.
NODE_DAEMON_STATE = ("/var/lib/kubelet", "/var/lib/docker", "/var/lib/containerd", "/var/lib/etcd", "/var/lib/cni")


def host_directory(text: str) -> str:
    """An absolute host directory outside the system's and the node daemons' ("" stays "": not set)."""
    if not text:
        return text
    norm = posixpath.normpath(text)
    if (not text.startswith("/") or ".." in text.split("/")
            or (system_path(norm) and not norm.startswith("/var/lib/")) or path_within(norm, NODE_DAEMON_STATE)):
        raise argparse.ArgumentTypeError(
            f"{text!r} must be an absolute path without '..', outside system directories and the node daemons' state")
    return norm


def network_policy_peer(text: str) -> dict:
    """One NetworkPolicyPeer from JSON (a namespaceSelector, podSelector and/or ipBlock)."""
    try:
        peer = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(peer, dict) or not peer or set(peer) - {"namespaceSelector", "podSelector", "ipBlock"}:
        raise argparse.ArgumentTypeError("a NetworkPolicyPeer: an object of namespaceSelector, podSelector, ipBlock")
    return peer


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parser().parse_args(list(argv) if argv is not None else None)
    except SystemExit as e:  # --help, or a usage error: a return code, for `pagoda operator`
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    policy = None
    if args.admission_port:
        if not (args.admission_cert_file and args.admission_key_file):
            print(
                "pagoda operator: --admission-port needs --admission-cert-file and --admission-key-file",
                file=sys.stderr,
            )
            return 2
        try:
            policy = admission_policy(args)
        except (ValueError, yaml.YAMLError) as e:
            print(f"pagoda operator: admission policy: {e}", file=sys.stderr)
            return 2
    from pagoda_operator.tracing import OperatorTracer

    try:
        tracer = OperatorTracer.from_env(os.environ)  # off unless an OTLP endpoint is set
    except ValueError as e:
        print(f"pagoda operator: tracing: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        logging.getLogger("kopf").setLevel(logging.WARNING)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)

    import kopf  # imported here so `--help` works without a cluster

    from pagoda_operator import memory

    memory.limit_arenas()  # before any thread of ours or kopf's starts

    from pagoda_operator.handlers import (
        KOPF_THREADS,
        build_registry,
        operator_settings,
    )
    from pagoda_operator.kube import Kube, load_configuration
    from pagoda_operator.leader import LeaderElector, default_identity
    from pagoda_operator.reconcile import Context
    from pagoda_operator.watch_cache import CachedKube

    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads it
    # one connection per thread that calls the API server: the reconcile passes' threads, the
    # ticker's, kopf's handler threads, the lease, webhook and metrics threads, and the
    # LeaderWorkerSet watches (one per namespace watched; optional_watch.py)
    kube = Kube(load_configuration(args.kubeconfig),
                connections=2 * args.workers + KOPF_THREADS + 4 + max(1, len(args.namespace)))
    if policy is not None:  # first: /healthz (readiness) then means the webhook answers too
        start_admission_webhook(args, policy, kube)
    if args.metrics_port:
        telemetry.serve(args.metrics_port, args.metrics_address)

    # An asyncio.Event on our own loop: kopf waits for a threading.Event (or a concurrent Future)
    # in an executor thread, which then blocks the interpreter's exit after SIGTERM.
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    renewing = threading.Event()  # set to stop the lease renewal thread
    lost = threading.Event()
    elector = None
    if args.leader_elect:
        ns = args.lease_namespace or os.environ.get("POD_NAMESPACE") or "default"
        elector = LeaderElector(
            kube,
            ns,
            args.lease_name,
            lease_s=args.lease_duration,
            renew_s=args.lease_renew or max(1.0, args.lease_duration / 3),
            retry_s=max(1.0, args.lease_duration / 5),
            grace_s=args.lease_grace,
        )
        try:
            if not elector.acquire():
                return 1
        except KeyboardInterrupt:
            return 130

        def on_lost() -> None:
            lost.set()
            loop.call_soon_threadsafe(stop.set)

        elector.keep(renewing, on_lost)

    settings = builders.Settings(
        daemon_image=args.daemon_image,
        image_pull_policy=args.image_pull_policy,
        network_policy=args.network_policy,
        http_from=tuple(args.network_policy_http_from) or builders.ALL_NAMESPACES,
        node_model_cache=args.node_model_cache,
    )
    # Passes read from watch-fed caches (watch_cache.py); the elector above reads its Lease live.
    # Elastic EP: the secret the daemons' admin keys derive from (the chart's; elastic.py).
    operator_secret = os.environ.get(elastic.OPERATOR_SECRET_ENV, "").encode() or None
    if operator_secret is None:
        logging.getLogger("pagoda_operator").warning(
            "%s is not set: elastic InferenceServices serve at their start size, unresized",
            elastic.OPERATOR_SECRET_ENV)
    endpoints = tuple(e for e in (args.model_config_endpoint or [model_config.DEFAULT_ENDPOINT]) if e != "none")
    lws_served = leader_worker_set.Discovery(
        lambda: kube.served(leader_worker_set.API_VERSION, leader_worker_set.PLURAL), args.lws_discovery_interval)
    lws_served()  # asked once before any pass: a pass at start renders the layout the cluster serves
    ctx = Context(kube=CachedKube(kube), settings=settings, scrape_timeout=args.scrape_timeout,
                  operator_secret=operator_secret, tracer=tracer,
                  model_configs=model_config.ModelConfigs(endpoints, args.scrape_timeout) if endpoints else None,
                  leader_worker_sets=lws_served)
    registry = build_registry(ctx, interval=args.interval, namespaces=args.namespace, workers=args.workers,
                              lws_recheck_s=args.lws_discovery_interval)
    logging.getLogger("pagoda_operator").info(
        "operator running: %s, interval %.1fs, daemon image %s",
        "namespaces " + ",".join(args.namespace) if args.namespace else "all namespaces",
        args.interval,
        args.daemon_image,
    )
    try:
        kopf.run(
            loop=loop,
            registry=registry,
            settings=operator_settings(workers=args.workers),
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=args.liveness,
            stop_flag=stop,
            # kopf would otherwise derive an identity from getpass.getuser(), which raises for a
            # uid without a passwd entry (the chart runs the operator as uid 65532).
            identity=elector.identity if elector is not None else default_identity(),
        )
    finally:
        renewing.set()
        loop.close()
        if tracer is not None:
            tracer.shutdown()
        if elector is not None and not lost.is_set():
            elector.release()
    return 1 if lost.is_set() else 0
