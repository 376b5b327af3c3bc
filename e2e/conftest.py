"""Fixtures for end-to-end tests against a real Kubernetes control plane.

``kube_cluster`` (session): etcd + kube-apiserver + kube-controller-manager + kube-scheduler
on loopback, built from source by ``e2e/cluster/ensure-k8s.sh`` and started by
``e2e/cluster/start-cluster.sh``; nodes are fake (``fake_kubelet.py``). ``kube_namespace``
(function): a fresh namespace per test.

``local_cluster`` (session): a second cluster with one real node (a kubelet and Debian's dockerd,
``e2e/cluster/node.sh``), the images built by ``e2e/image/build-images.sh`` and the Helm chart
installed: what ``make quickstart`` runs, for tests with real containers.

The contract other tests rely on is documented in docs/testing.md; keep the two in step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

E2E_DIR = Path(__file__).resolve().parent
CLUSTER_DIR = E2E_DIR / "cluster"
ENSURE = CLUSTER_DIR / "ensure-k8s.sh"
START = CLUSTER_DIR / "start-cluster.sh"
STOP = CLUSTER_DIR / "stop-cluster.sh"
FAKE_KUBELET = CLUSTER_DIR / "fake_kubelet.py"
ROOT = E2E_DIR.parent
BUILD_IMAGES = E2E_DIR / "image" / "build-images.sh"
LOCAL_VALUES = E2E_DIR / "quickstart" / "values.yaml"
CHART = ROOT / "charts" / "pagoda"

T = TypeVar("T")


def _env_flag(name: str) -> bool | None:
    """True/False for a set boolean environment variable, None when unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    return value not in ("0", "false", "no", "off")


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl/helm call; unlike its base class, its message shows stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


class FakeKubeletHandle:
    """A running ``fake_kubelet.py``: one Ready node whose scheduled pods turn Running."""

    def __init__(self, cluster: KubeCluster, node: str, process: subprocess.Popen, log_path: Path):
        self.cluster, self.node, self.process, self.log_path = cluster, node, process, log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, delete_node: bool = True) -> None:
        """Stop the process; by default also delete the Node so that no later pod is
        scheduled onto a node nobody runs. Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if delete_node and self.cluster.running:
            self.cluster.kubectl("delete", "node", self.node, "--ignore-not-found", "--wait=false", check=False)


class KubeCluster:
    """A running test cluster. See docs/testing.md for the contract."""

    def __init__(self, state_dir: Path, bin_dir: Path):
        self.state_dir = state_dir
        self.bin_dir = bin_dir
        self.logs_dir = state_dir / "logs"
        self.kubeconfig = str(state_dir / "admin.kubeconfig")
        info = dict(line.split("=", 1) for line in (state_dir / "cluster.env").read_text().splitlines() if "=" in line)
        self.server: str = info["SERVER"]
        self.kubectl_path = self._find_kubectl()
        self.helm_path = str(bin_dir / "helm")
        # For any subprocess a test starts (an operator, a script): the cluster's kubeconfig,
        # our kubectl and helm first on PATH, helm's caches inside the state dir.
        self.env: dict[str, str] = {
            **os.environ,
            "KUBECONFIG": self.kubeconfig,
            "PATH": f"{Path(self.kubectl_path).parent}{os.pathsep}{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "HELM_CACHE_HOME": str(state_dir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(state_dir / "helm" / "config"),
            "HELM_DATA_HOME": str(state_dir / "helm" / "data"),
        }
        self.fake_kubelets: list[FakeKubeletHandle] = []
        self.running = True

    def _find_kubectl(self) -> str:
        # ensure-k8s.sh only builds kubectl when none is on PATH (or when asked), so one in
        # the cache is the one meant for these tests.
        for candidate in (os.environ.get("PAGODA_KUBECTL"), str(self.bin_dir / "kubectl"), shutil.which("kubectl")):
            if candidate and os.access(candidate, os.X_OK):
                return candidate
        raise RuntimeError("no kubectl: run e2e/cluster/ensure-k8s.sh --with-kubectl")

    # ---- command-line clients --------------------------------------------------------
    def _run(self, argv: list[str], check: bool, input: str | None, timeout: float) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, input=input, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess:
        """Run kubectl against this cluster (text mode, output captured)."""
        # A discovery cache per cluster: the shared ~/.kube/cache is keyed by host:port, and a
        # later cluster on the same port would see this one's stale API list.
        argv = [self.kubectl_path, f"--kubeconfig={self.kubeconfig}",
                f"--cache-dir={self.state_dir / 'kubectl-cache'}", *args]
        return self._run(argv, check, input, timeout)

    def kubectl_json(self, *args: str, timeout: float = 120) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300) -> subprocess.CompletedProcess:
        """Run helm against this cluster (text mode, output captured)."""
        return self._run([self.helm_path, f"--kubeconfig={self.kubeconfig}", *args], check, input, timeout)

    def apply(self, manifest: str | dict | list[dict], namespace: str | None = None) -> subprocess.CompletedProcess:
        """``kubectl apply -f -`` of YAML text, one object, or a list of objects."""
        if not isinstance(manifest, str):
            docs = manifest if isinstance(manifest, list) else [manifest]
            manifest = yaml.safe_dump_all(docs)
        ns = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns, "-f", "-", input=manifest)

    # ---- namespaces, nodes, waiting --------------------------------------------------
    def create_namespace(self, prefix: str = "e2e") -> str:
        """Create a uniquely named namespace and wait until pods can be created in it."""
        prefix = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:50] or "e2e"
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.kubectl("create", "namespace", name)
        # The ServiceAccount admission plugin rejects pods until the token controller has
        # made the namespace's `default` ServiceAccount (usually well under a second).
        self.wait_for(lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
                      timeout=30, what=f"ServiceAccount default in namespace {name}")
        return name

    def delete_namespace(self, name: str, wait: bool = False) -> None:
        self.kubectl("delete", "namespace", name, "--ignore-not-found", f"--wait={str(wait).lower()}", check=False)

    def start_fake_kubelet(self, node_name: str, gpus: int = 8, *, cpu: str = "32", memory: str = "256Gi",
                           labels: dict[str, str] | None = None, max_pods: int = 110,
                           timeout: float = 30) -> FakeKubeletHandle:
        """Register a Ready node with ``gpus`` ``nvidia.com/gpu`` and start marking the pods
        scheduled on it Running/Ready. Returns once the node is Ready and untainted. The
        handle is stopped (and its Node deleted) at session teardown, or by ``.stop()``."""
        log_path = self.logs_dir / f"fake-kubelet-{node_name}.log"
        argv = [sys.executable, str(FAKE_KUBELET), node_name, f"--kubeconfig={self.kubeconfig}",
                f"--gpus={gpus}", f"--cpu={cpu}", f"--memory={memory}", f"--max-pods={max_pods}",
                f"--pid-file={self.state_dir / f'fake-kubelet-{node_name}.pid'}"]
        argv += [f"--label={k}={v}" for k, v in (labels or {}).items()]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                       stdin=subprocess.DEVNULL)
        handle = FakeKubeletHandle(self, node_name, process, log_path)
        self.fake_kubelets.append(handle)

        def node_ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"fake kubelet for {node_name} exited:\n{handle.log()[-3000:]}")
            proc = self.kubectl("get", "node", node_name, "-o", "json", check=False)
            if proc.returncode != 0:
                return False
            node = json.loads(proc.stdout)
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
            tainted = any(t["key"].startswith("node.kubernetes.io/") for t in node["spec"].get("taints") or [])
            return ready and not tainted

        self.wait_for(node_ready, timeout=timeout, what=f"fake node {node_name} Ready")
        return handle

    def wait_for(self, predicate: Callable[[], T], timeout: float = 60, interval: float = 0.25,
                 what: str = "condition") -> T:
        """Call ``predicate`` until it returns something truthy and return that. A
        KubectlError (say, the object does not exist yet) counts as "not yet"."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while True:
            try:
                last = predicate()
                if last:
                    return last
            except KubectlError as e:
                last = e
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last result: {last!r}")
            time.sleep(interval)

    def log_tail(self, component: str, lines: int = 50) -> str:
        """Last lines of a component's log (etcd, kube-apiserver, kube-controller-manager, ...)."""
        path = self.logs_dir / f"{component}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        for handle in self.fake_kubelets:
            handle.stop(delete_node=False)
        subprocess.run([str(STOP), str(self.state_dir)], capture_output=True, text=True, check=False)
        self.running = False


HOST_SYSCTLS = ("net/ipv4/ip_forward", "vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")


def host_settings() -> dict[str, str]:
    """What a node must not change on this machine: the kernel settings kubelets and dockerd like
    to rewrite, and the iptables rules (``iptables -S`` of filter, nat, mangle; no counters)."""
    out = {k: Path("/proc/sys", k).read_text().strip() for k in HOST_SYSCTLS}
    for table in ("filter", "nat", "mangle"):
        proc = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True, check=False)
        out[f"iptables/{table}"] = proc.stdout if proc.returncode == 0 else f"unavailable: {proc.stderr.strip()}"
    return out


class LocalCluster(KubeCluster):
    """A cluster with one real node: pods run as containers of the node's dockerd, get their own
    IP on the node's bridge (reachable from this machine only), and reach the API server the
    in-cluster way. The chart is installed (operator + topology agent). See docs/testing.md."""

    def __init__(self, state_dir: Path, bin_dir: Path):
        super().__init__(state_dir, bin_dir)
        env = {}
        for name in ("node.env", "docker.env"):
            env.update(dict(line.split("=", 1) for line in (state_dir / name).read_text().splitlines() if "=" in line))
        self.node: str = env["NODE_NAME"]
        self.node_ip: str = env["NODE_IP"]
        self.pod_cidr: str = env["POD_CIDR"]
        self.bridge: str = env["BRIDGE"]
        self.docker_host: str = env["DOCKER_HOST"]
        self.env["DOCKER_HOST"] = self.docker_host
        self.daemon_image = ""
        self.operator_image = ""
        self.model_dir = Path()
        self.release, self.release_namespace = "pagoda", "pagoda-system"
        self.host_settings_before: dict[str, str] = {}  # host_settings() before the node started

    def moe_model_dir(self) -> Path:
        """A tiny random Qwen3-MoE (8 experts, top 2) beside the Qwen3, built on first use."""
        from pagoda_daemon.models.tiny import build_tiny_model

        model = self.model_dir.parent / "tiny-qwen3-moe"
        if not (model / "config.json").exists():
            build_tiny_model("qwen3_moe", model, seed=3)
            for f in model.iterdir():  # safetensors writes 0600; the daemon runs as another user
                f.chmod(0o644)
        return model

    def bridge_mac(self) -> str:
        """The node bridge's MAC address (fixed by node.sh; see there why it must not move)."""
        return Path(f"/sys/class/net/{self.bridge}/address").read_text().strip()

    @staticmethod
    def host_settings() -> dict[str, str]:
        """This machine's settings a node must leave alone (compare with ``host_settings_before``)."""
        return host_settings()

    def docker(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        """The docker CLI against the node's dockerd."""
        return self._run(["docker", "-H", self.docker_host, *args], check, None, timeout)

    def endpoints(self, service: str, namespace: str) -> list[str]:
        """IPs of the ready pods behind a Service (its Endpoints). There is no kube-proxy, so
        ClusterIPs route nowhere: clients talk to these directly."""
        proc = self.kubectl("get", "endpoints", service, "-n", namespace, "-o", "json", check=False)
        if proc.returncode != 0:
            return []
        subsets = json.loads(proc.stdout).get("subsets") or []
        return sorted(a["ip"] for s in subsets for a in s.get("addresses") or [])

    def build_images(self) -> None:
        env = {**self.env, "PYTHON": sys.executable}
        proc = subprocess.run([str(BUILD_IMAGES)], capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"build-images.sh failed:\n{proc.stdout}\n{proc.stderr}")
        tags = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "_IMAGE=" in line)
        self.daemon_image, self.operator_image = tags["DAEMON_IMAGE"], tags["OPERATOR_IMAGE"]

    def install_chart(self) -> None:
        self.helm(
            "upgrade", "--install", self.release, str(CHART), "--namespace", self.release_namespace,
            "--create-namespace", "-f", str(LOCAL_VALUES),
            "--set-string", f"image.tag={self.operator_image.split(':', 1)[1]}",
            "--set-string", f"daemonImage.tag={self.daemon_image.split(':', 1)[1]}",
            "--wait", "--timeout", "300s",
        )
        # helm --wait sees the operator Ready; the endpoints controller adds it to the webhook's
        # Service a moment later, and until then the API server refuses InferenceService writes
        # (failurePolicy Fail: "no endpoints available").
        self.wait_for(lambda: self.endpoints(f"{self.release}-operator-webhook", self.release_namespace),
                      timeout=60, what="the admission webhook's endpoints")


# ---- the build/skip decision -------------------------------------------------------------
def _ensure_binaries(config: pytest.Config) -> Path:
    """Build or fetch what is missing when allowed (PAGODA_E2E_BUILD=1, or in CI unless
    PAGODA_E2E_BUILD=0); otherwise skip the cluster tests when something is missing."""
    build = _env_flag("PAGODA_E2E_BUILD")
    if build is None:
        build = bool(_env_flag("CI"))
    if build:
        # A cold build runs ~10 minutes: let its progress through pytest's output capture.
        capture = config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            rc = subprocess.run([str(ENSURE)], check=False).returncode
        if rc != 0:
            pytest.fail(f"{ENSURE} failed with exit code {rc}; its output above names the step and its log",
                        pytrace=False)
    else:
        check = subprocess.run([str(ENSURE), "--check"], capture_output=True, text=True, check=False)
        if check.returncode != 0:
            missing = "; ".join(check.stdout.split("\n")).strip("; ")
            pytest.skip(f"no Kubernetes test binaries ({missing}); run e2e/cluster/ensure-k8s.sh once "
                        "(~12 min cold on 2 cores, cached in ~/.cache/pagoda) or set PAGODA_E2E_BUILD=1")
    return Path(subprocess.run([str(ENSURE), "--print-bin-dir"], capture_output=True, text=True,
                               check=True).stdout.strip())


def _ensure_local_cluster_tools(config: pytest.Config) -> None:
    """The real node's extra needs: root, the kubelet and Debian packages, the image pieces.
    Built when allowed (as for kube_cluster), else the tests that need them are skipped."""
    if os.geteuid() != 0:
        pytest.skip("the real-node cluster needs root (dockerd, kubelet, a network bridge)")
    build = _env_flag("PAGODA_E2E_BUILD")
    if build is None:
        build = bool(_env_flag("CI"))
    env = {**os.environ, "PYTHON": sys.executable}
    if build:
        capture = config.pluginmanager.getplugin("capturemanager")
        with capture.global_and_fixture_disabled():
            for argv in ([str(ENSURE), "--with-kubelet"], [str(BUILD_IMAGES), "--prepare-only"]):
                rc = subprocess.run(argv, check=False, env=env).returncode
                if rc != 0:
                    pytest.fail(f"{' '.join(argv)} failed with exit code {rc}; its output above names the step and "
                                "its log", pytrace=False)
        return
    missing = []
    for argv in ([str(ENSURE), "--with-kubelet", "--check"], [str(BUILD_IMAGES), "--check"]):
        check = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
        if check.returncode != 0:
            missing.append(check.stdout.strip().replace("\n", "; "))
    if missing:
        pytest.skip(f"real-node cluster not built ({'; '.join(missing)}); run make quickstart once, "
                    "or set PAGODA_E2E_BUILD=1")


def _start_cluster(state_dir: Path, bin_dir: Path, extra_env: dict[str, str] | None = None) -> None:
    env = {**os.environ, "PAGODA_K8S_BIN": str(bin_dir), "PAGODA_K8S_OWNER_PID": str(os.getpid()),
           **(extra_env or {})}
    # Two attempts: free ports are picked just before the servers bind them, so another
    # process can, rarely, grab one in between.
    for attempt in (1, 2):
        proc = subprocess.run([str(START), str(state_dir)], capture_output=True, text=True, env=env, check=False)
        if proc.returncode == 0:
            return
        if attempt == 2:
            raise RuntimeError(f"start-cluster.sh failed (state dir {state_dir}):\n{proc.stdout}\n{proc.stderr}")


def _state_dir(tmp_path_factory: pytest.TempPathFactory, name: str, env_name: str) -> Path:
    """PAGODA_E2E_STATE_DIR/<env_name>-<pid> (for CI to keep as an artifact), else a pytest temp dir."""
    root = os.environ.get("PAGODA_E2E_STATE_DIR")
    if root:
        state_dir = Path(root).resolve() / f"{env_name}-{os.getpid()}"
        state_dir.mkdir(parents=True, exist_ok=True)
        return state_dir
    return tmp_path_factory.mktemp(name)


_CURRENT: KubeCluster | None = None


@pytest.fixture(scope="session")
def kube_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    """A real control plane for the whole test session; see docs/testing.md."""
    global _CURRENT
    bin_dir = _ensure_binaries(request.config)
    state_dir = _state_dir(tmp_path_factory, "kube-cluster", "cluster")
    _start_cluster(state_dir, bin_dir)
    cluster = _CURRENT = KubeCluster(state_dir, bin_dir)
    try:
        yield cluster
    finally:
        cluster.stop()
        _CURRENT = None
        _keep_logs_or_drop_data(request, "kube_cluster", cluster, state_dir)


def _keep_logs_or_drop_data(request: pytest.FixtureRequest, name: str, cluster: KubeCluster,
                            state_dir: Path) -> None:
    """After a stopped cluster: point at its logs when the run failed; otherwise drop etcd's
    data (64 MB of preallocated WAL), keeping certs and logs."""
    if request.session.testsfailed:
        reporter = request.config.pluginmanager.getplugin("terminalreporter")
        if reporter:
            reporter.write_line(f"{name}: logs of the failed run kept in {cluster.logs_dir}")
    else:
        shutil.rmtree(state_dir / "etcd", ignore_errors=True)


_LOCAL: LocalCluster | None = None


@pytest.fixture(scope="session")
def local_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A cluster with one real node, the images loaded and the chart installed; see docs/testing.md."""
    global _LOCAL
    bin_dir = _ensure_binaries(request.config)
    _ensure_local_cluster_tools(request.config)
    state_dir = _state_dir(tmp_path_factory, "local-cluster", "local-cluster")
    settings_before = host_settings()
    # Images persist in ~/.cache/pagoda/docker/e2e (another slot when a second run holds it).
    _start_cluster(state_dir, bin_dir, {"PAGODA_K8S_NODE": "1", "PAGODA_DOCKER_SLOT": "e2e"})
    cluster = _LOCAL = LocalCluster(state_dir, bin_dir)
    cluster.host_settings_before = settings_before
    try:
        cluster.build_images()
        model = state_dir / "models" / "tiny-qwen3"
        from pagoda_daemon.cli import tiny_model_dir

        shutil.copytree(tiny_model_dir("qwen3"), model)
        # The daemon runs as a non-root user; the copy must be readable by it.
        for path in [model, *model.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        cluster.model_dir = model
        cluster.install_chart()
        yield cluster
    finally:
        cluster.stop()
        _LOCAL = None
        _keep_logs_or_drop_data(request, "local_cluster", cluster, state_dir)


@pytest.fixture
def kube_namespace(kube_cluster: KubeCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test, deleted (without waiting) afterwards."""
    name = kube_cluster.create_namespace(request.node.name)
    yield name
    kube_cluster.delete_namespace(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failed cluster test, point at the cluster's logs in the report."""
    report = yield
    if report.failed and _CURRENT is not None and "kube_cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("kube_cluster", f"server {_CURRENT.server}\nlogs: {_CURRENT.logs_dir}\n"
                                                f"kube-apiserver log tail:\n{_CURRENT.log_tail('kube-apiserver', 15)}"))
    if report.failed and _LOCAL is not None and "local_cluster" in getattr(item, "fixturenames", ()):
        report.sections.append(("local_cluster", f"server {_LOCAL.server}, node {_LOCAL.node} ({_LOCAL.node_ip})\n"
                                                 f"logs: {_LOCAL.logs_dir} (kubelet.log, dockerd.log, ...)\n"
                                                 f"kubelet log tail:\n{_LOCAL.log_tail('kubelet', 15)}"))
    return report
