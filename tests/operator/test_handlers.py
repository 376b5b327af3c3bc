"""The kopf side: registry contents, node labels from NodeTopology, the ticker, events."""

from __future__ import annotations

from pagoda_operator import telemetry
from pagoda_operator.builders import Settings
from pagoda_operator.handlers import Ticker, build_registry, operator_settings, sync_node_labels
from pagoda_operator.reconcile import Context
from tests.operator.operator_fakes import isvc, topology


def node(name: str, **labels: str) -> dict:
    return {"kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **labels}}}


def test_node_labels_follow_the_topology(fake_kube):
    ctx = Context(kube=fake_kube)
    fake_kube.put(node("n1"))
    assert sync_node_labels(ctx, "n1", topology("n1", 8, [[0, 1, 2, 3], [4, 5, 6, 7]])) is True
    assert fake_kube.get("Node", None, "n1")["metadata"]["labels"]["pagoda.dev/nvlink-gpus"] == "4"
    assert sync_node_labels(ctx, "n1", topology("n1", 8, [[0, 1, 2, 3], [4, 5, 6, 7]])) is False  # no write
    assert sync_node_labels(ctx, "n1", topology("n1", 8, [list(range(8))])) is True
    assert fake_kube.get("Node", None, "n1")["metadata"]["labels"]["pagoda.dev/nvlink-gpus"] == "8"
    assert sync_node_labels(ctx, "n1", None) is True  # NodeTopology deleted: label removed
    labels = fake_kube.get("Node", None, "n1")["metadata"]["labels"]
    assert "pagoda.dev/nvlink-gpus" not in labels and labels["kubernetes.io/hostname"] == "n1"
    assert sync_node_labels(ctx, "missing", topology("missing", 8)) is False


def test_ticker_passes_over_every_service_and_posts_events(fake_kube):
    fake_kube.put(isvc("a"))
    fake_kube.put(isvc("b", namespace="other", resources={"gpusPerReplica": 8}, parallelism={"tensor": 3}))
    ctx = Context(kube=fake_kube, settings=Settings(daemon_image="img"))
    Ticker(ctx, interval=1).tick()
    assert fake_kube.get("Deployment", "default", "a") is not None
    assert fake_kube.get("Deployment", "other", "b") is None
    (event,) = fake_kube.list("Event", "other")
    assert event["reason"] == "InvalidSpec" and event["type"] == "Warning"
    assert event["involvedObject"] == {
        "apiVersion": "pagoda.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "b",
        "namespace": "other",
        "uid": "uid-b",
    }
    # namespaced operators only pass over their namespaces
    Ticker(ctx, interval=1, namespaces=["default"]).tick()
    assert len(fake_kube.list("Event", "other")) == 1


def test_the_periodic_pass_leaves_alone_what_an_event_just_reconciled(fake_kube):
    """Each pass costs the same CPU: the periodic round skips a service reconciled within its
    interval, unless the service keeps time (an autoscaler steps on each round)."""
    from pagoda_operator.reconcile import reconcile

    now = [1000.0]
    fake_kube.put(isvc("quiet"))
    fake_kube.put(isvc("clocked", autoscaling={"minReplicas": 1, "maxReplicas": 2, "metric": "requestsWaiting",
                                               "target": 2}))
    fake_kube.put(isvc("never"))
    ctx = Context(kube=fake_kube, settings=Settings(daemon_image="img"), clock=lambda: now[0])
    reconcile(ctx, "default", "quiet", "pod")
    reconcile(ctx, "default", "clocked", "pod")
    ticker = Ticker(ctx, interval=15)
    now[0] += 10
    assert ticker.targets() == [("default", "clocked"), ("default", "never")]
    ticker.tick()
    now[0] += 6  # 16 s after the event's pass, 6 s after the round's
    assert ticker.targets() == [("default", "clocked"), ("default", "quiet")]
    ctx.forget("default", "never")
    assert ("default", "never") in ticker.targets()
    telemetry.forget("default", "clocked")  # its autoscaler's series live in the process-wide registry


def test_registry_has_no_finalizer_handlers(fake_kube):
    """Deleting an InferenceService must never wait for the operator (no kopf timers/daemons/on.delete)."""
    registry = build_registry(Context(kube=fake_kube), interval=1)
    assert not list(registry._spawning.get_all_handlers())
    ids = {h.id for h in registry._changing.get_all_handlers()}
    assert ids == {"reconcile"}
    watching = {h.id for h in registry._watching.get_all_handlers()}
    # LeaderWorkerSets: the operator's own watch, not kopf's (optional_watch.py)
    assert watching == {"forget", "deployment", "statefulset", "pod", "service", "configmap", "node-labels"}


def test_operator_settings_keep_kopf_out_of_status():
    s = operator_settings()
    assert s.peering.standalone is True
    assert type(s.persistence.progress_storage).__name__ == "AnnotationsProgressStorage"


def test_the_operator_imports_only_the_daemons_declarations():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = str(root / "operator")
    code = "\n".join(
        [
            f"import sys; sys.path.insert(0, {path!r})",
            "import pagoda_operator.cli, pagoda_operator.handlers, pagoda_operator.reconcile",
            # the daemon's option and capability declarations, its layout rules, its rule for
            # adapter names and its parse of hf_overrides (standard library only), nothing else
            "declarations = {'pagoda_daemon', 'pagoda_daemon.config', 'pagoda_daemon.options', "
            "'pagoda_daemon.capabilities', 'pagoda_daemon.model_uri', 'pagoda_daemon.distributed', "
            "'pagoda_daemon.distributed.layout', 'pagoda_daemon.lora', 'pagoda_daemon.lora.names', "
            "'pagoda_daemon.hf_overrides'}",
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'pagoda_daemon', 'transformers', "
            "'fastapi', 'zmq', 'numpy') and m not in declarations]",
            "assert not bad, bad",
            "assert pagoda_operator.cli.main(['--help']) == 0",
            "assert pagoda_operator.cli.main(['--no-such-flag']) == 2",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--daemon-image" in out.stdout and "--lease-duration" in out.stdout


def test_kopf_works_on_a_bounded_number_of_objects_at_once():
    assert operator_settings(workers=4).queueing.worker_limit == 64
    assert operator_settings(workers=8).queueing.worker_limit == 128


def test_nodes_are_labelled_with_the_models_their_cache_holds_and_unlabelled_when_they_go(fake_kube):
    from pagoda_operator.placement import model_label

    ctx = Context(kube=fake_kube)
    fake_kube.put(node("n1", **{"models.pagoda.dev/m-stale": "true"}))
    t = topology("n1", 8, [list(range(8))])
    t["status"] = {"modelCache": {"models": [
        {"namespace": "team-a", "source": "hf://org/llm", "complete": True, "inUse": True},
        {"namespace": "team-b", "source": "s3://b/m", "complete": False, "inUse": True},  # still downloading
        {"namespace": 3, "source": None, "complete": True},  # not the agent's shape: ignored
    ]}}
    assert sync_node_labels(ctx, "n1", t) is True
    labels = fake_kube.get("Node", None, "n1")["metadata"]["labels"]
    held = model_label("team-a", "hf://org/llm")
    assert {k for k in labels if k.startswith("models.pagoda.dev/")} == {held}  # the stale one went
    assert model_label("team-b", "hf://org/llm") != held != model_label("team-a", "hf://org/llm@v2")
    assert len(held.split("/", 1)[1]) <= 63
    assert sync_node_labels(ctx, "n1", t) is False
    t["status"]["modelCache"]["models"] = []  # evicted
    assert sync_node_labels(ctx, "n1", t) is True
    assert not any(k.startswith("models.pagoda.dev/") for k in fake_kube.get("Node", None, "n1")["metadata"]["labels"])


def test_leader_worker_set_events_reach_the_owners_pass_through_the_operators_own_watch(fake_kube):
    """Not a kopf handler (optional_watch.py says why): started with the ticker while API
    discovery says LeaderWorkerSets are served, label-selected like kopf's child watches, each
    event asks for its owner's pass; stopped with the ticker."""
    import time

    from pagoda_operator.builders import INSTANCE_LABEL
    from pagoda_operator.handlers import OWNED_SELECTOR

    def passes_after_lws_events() -> float:
        return sum(telemetry.REGISTRY.get_sample_value(
            "pagoda_operator_reconciles_total", {"trigger": "leaderworkerset", "result": r}) or 0
            for r in ("changed", "unchanged", "gone", "error"))

    asked: list[tuple[str | None, str | None]] = []

    def watch(kind, namespace, selector, resource_version, timeout_s):
        asked.append((namespace, selector))
        if len(asked) == 1:
            yield {"type": "ADDED", "object": {"kind": kind, "metadata": {
                "name": "a-group", "namespace": "default", "resourceVersion": "1", "labels": {INSTANCE_LABEL: "a"}}}}
        else:
            time.sleep(0.05)  # as a server holds the request open

    fake_kube.watch = watch
    fake_kube.put(isvc("a"))
    before = passes_after_lws_events()
    ctx = Context(kube=fake_kube, settings=Settings(daemon_image="img"), leader_worker_sets=lambda: True)
    registry = build_registry(ctx, interval=3600, namespaces=["default"])
    activities = {h.id.rsplit(".", 1)[-1]: h for h in registry._activities.get_all_handlers()}
    activities["start_ticker"].fn()
    deadline = time.monotonic() + 10
    while passes_after_lws_events() == before:
        assert time.monotonic() < deadline, "no pass followed the LeaderWorkerSet's event"
        time.sleep(0.02)
    activities["stop_ticker"].fn()
    assert asked[0] == ("default", OWNED_SELECTOR)
    assert OWNED_SELECTOR == "app.kubernetes.io/managed-by=pagoda-operator,pagoda.dev/inferenceservice"


def test_a_childs_event_asks_for_its_owners_pass_and_returns_at_once(fake_kube):
    """Child handlers run on kopf's event loop: they keep the object and ask the pass pool for
    the owner's pass instead of running it (pass_pool.py says why); the pass runs on a pool
    thread and writes the children."""
    import asyncio
    import inspect
    import time

    from pagoda_operator.builders import INSTANCE_LABEL

    fake_kube.put(isvc("a"))
    ctx = Context(kube=fake_kube, settings=Settings(daemon_image="img"))
    registry = build_registry(ctx, interval=1)
    handlers = {h.id: h for h in registry._watching.get_all_handlers()}
    assert all(inspect.iscoroutinefunction(handlers[i].fn) for i in handlers if i != "node-labels")
    pod = {"kind": "Pod", "metadata": {"name": "a-1", "namespace": "default", "labels": {INSTANCE_LABEL: "a"}}}
    asyncio.run(handlers["pod"].fn(event={"type": "ADDED", "object": pod}, labels=pod["metadata"]["labels"],
                                   namespace="default"))
    deadline = time.monotonic() + 10
    while fake_kube.get("Deployment", "default", "a") is None:
        assert time.monotonic() < deadline, "no pass ran for the pod's owner"
        time.sleep(0.02)
    (stop,) = [h for h in registry._activities.get_all_handlers() if h.id.endswith(".stop_ticker")]
    stop.fn()
