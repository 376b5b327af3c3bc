#!/usr/bin/env bash
# start-cluster.sh: start a loopback-only Kubernetes control plane for tests:
# etcd + kube-apiserver, plus kube-controller-manager and kube-scheduler (Deployments need
# the controllers to get ReplicaSets and pods, pods need the scheduler to get a node).
# By default there is no kubelet: run fake_kubelet.py to get a Ready node whose pods turn
# Running. With PAGODA_K8S_NODE=1 the cluster gets one real node instead (node.sh: Debian's
# dockerd, a kubelet, a CNI bridge; needs root and ensure-k8s.sh --with-kubelet): then the API
# server listens on the `kubernetes` Service's ClusterIP (10.96.N.1:443, an address of the node's
# bridge) so that pods reach it too, and every other port stays on 127.0.0.1.
#
# Usage: start-cluster.sh [STATE_DIR]        (or PAGODA_K8S_STATE; default /tmp/pagoda-k8s-$UID)
#
# The state dir ends up holding:
#   admin.kubeconfig   cluster-admin (bearer token) kubeconfig for kubectl/helm/clients
#   cluster.env        SERVER, ports, BIN, ... (shell syntax, for scripts)
#   pki/               CA, serving cert, service-account keys, tokens.csv
#   logs/<component>.log, <component>.pid, etcd/ (data)
#   node.env, docker.env  with PAGODA_K8S_NODE=1: the node's network and docker daemon
#
# Environment:
#   PAGODA_K8S_BIN          binaries dir (default: what `ensure-k8s.sh --print-bin-dir` says)
#   PAGODA_K8S_CONTROLLERS  1 (default) also start controller-manager + scheduler; 0: etcd + apiserver only
#   PAGODA_K8S_NODE         1: also start a real node (node.sh; implies the controllers). node.sh
#                           documents its own variables (PAGODA_DOCKER_SLOT, PAGODA_NODE_NAME).
#   PAGODA_K8S_OWNER_PID    stop the cluster by itself when this process exits (pytest's PID),
#                           so a killed test run leaves no servers behind
#   PAGODA_K8S_API_PORT, PAGODA_K8S_ETCD_PORT  fixed ports; by default free ones are picked, so
#                           several clusters (parallel test runs, other people) never clash.
#                           ETCD_PORT+1 and +2 (peer, metrics) are used too.
#   PAGODA_K8S_SERVICE_CIDR the Service range (default 10.0.0.0/24: 253 Services)
#   PAGODA_K8S_CONTROLLER_QPS  the controller-manager's and scheduler's client rate (burst twice
#                           that); by default their own defaults (20 and 50 requests/s in 1.20)
# Every port listens on 127.0.0.1 only. Stop with stop-cluster.sh STATE_DIR.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=e2e/lib.sh
. "$HERE/../lib.sh"
D=${1:-${PAGODA_K8S_STATE:-/tmp/pagoda-k8s-$(id -u)}}
mkdir -p "$D"
D=$(cd "$D" && pwd)     # absolute: it ends up in the kubeconfig and in process args
BIN=${PAGODA_K8S_BIN:-$("$HERE/ensure-k8s.sh" --print-bin-dir)}
CONTROLLERS=${PAGODA_K8S_CONTROLLERS:-1}
NODE=${PAGODA_K8S_NODE:-0}
if [ "$NODE" = 1 ]; then CONTROLLERS=1; fi

start_clock start-cluster
fail() {
  # Show why, then stop whatever did start, so a failed start leaves nothing running.
  echo "[start-cluster] ERROR: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then echo "[start-cluster] last lines of $2:" >&2; log_tail "$2" 25; fi
  "$HERE/stop-cluster.sh" "$D" >&2 || true
  exit 1
}

WANT=(kube-apiserver kube-controller-manager kube-scheduler)
if [ "$NODE" = 1 ]; then WANT+=(kubelet pause); fi
for b in "${WANT[@]}"; do
  [ -x "$BIN/$b" ] || { echo "[start-cluster] ERROR: $BIN/$b missing; run e2e/cluster/ensure-k8s.sh --with-kubelet" >&2; exit 1; }
done
command -v etcd >/dev/null || { echo "[start-cluster] ERROR: etcd not on PATH; run e2e/cluster/ensure-k8s.sh" >&2; exit 1; }
if [ -f "$D/kube-apiserver.pid" ] && kill -0 "$(cat "$D/kube-apiserver.pid")" 2>/dev/null; then
  echo "[start-cluster] ERROR: a cluster already runs from $D; stop-cluster.sh $D first" >&2; exit 1
fi

# ---- ports ---------------------------------------------------------------------------
# Ask the kernel for free loopback ports (bind to port 0) rather than hard-coding: fixed
# ports collide with a second test run on the same machine. All are held at once so they
# are distinct; the small window before our servers bind them is covered by the caller
# retrying (the pytest fixture does).
free_ports() {
  python3 - "$1" <<'PY'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
PY
}
read -r API_PORT CM_PORT SCHED_PORT ETCD_PORT ETCD_PEER_PORT ETCD_METRICS_PORT < <(free_ports 6)
API_PORT=${PAGODA_K8S_API_PORT:-$API_PORT}
if [ -n "${PAGODA_K8S_ETCD_PORT:-}" ]; then
  ETCD_PORT=$PAGODA_K8S_ETCD_PORT; ETCD_PEER_PORT=$((ETCD_PORT + 1)); ETCD_METRICS_PORT=$((ETCD_PORT + 2))
fi
BIND_IP=127.0.0.1
# 253 Services: enough for the e2e tests; benchmarks/operator_scale.py asks for more at its sizes
SERVICE_CIDR=${PAGODA_K8S_SERVICE_CIDR:-10.0.0.0/24}
# The controllers' own client rate limits pace how fast Deployments become pods: at 20 requests/s
# the controller-manager made about 5 pods/s, which set create-to-Ready at 100 and 200 objects
# (docs/benchmarks/2026-11-26-operator-scale.md). Large clusters raise them; the benchmark can.
CONTROLLER_QPS_FLAGS=()
if [ -n "${PAGODA_K8S_CONTROLLER_QPS:-}" ]; then
  CONTROLLER_QPS_FLAGS=(--kube-api-qps="$PAGODA_K8S_CONTROLLER_QPS" --kube-api-burst=$((2 * PAGODA_K8S_CONTROLLER_QPS)))
fi
if [ "$NODE" = 1 ]; then
  # The node's bridge first: the API server listens on one of its addresses.
  "$HERE/node.sh" net-up "$D" || fail "could not set up the node's network"
  # shellcheck disable=SC1091
  . "$D/node.env"
  BIND_IP=$API_IP API_PORT=443
fi
SERVER=https://$BIND_IP:$API_PORT

# ---- certificates and credentials ----------------------------------------------------
# Made once per state dir (~0.3 s). The admin authenticates with a static bearer token
# (tokens.csv, group system:masters): simplest credential every client understands.
mkdir -p "$D/pki" "$D/logs"
if [ ! -f "$D/pki/tokens.csv" ]; then
  (
    cd "$D/pki"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 3650 -subj "/CN=pagoda-test-ca" 2>/dev/null
    openssl genrsa -out sa.key 2048 2>/dev/null
    openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
    # The API server's client certificate towards kubelets (logs, exec, port-forward).
    openssl req -newkey rsa:2048 -nodes -keyout kubelet-client.key -out kubelet-client.csr \
      -subj "/O=system:masters/CN=kube-apiserver-kubelet-client" 2>/dev/null
    printf "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n" > client.cnf
    openssl x509 -req -in kubelet-client.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out kubelet-client.crt \
      -days 3650 -extfile client.cnf 2>/dev/null
    umask 077
    echo "$(openssl rand -hex 16),admin,admin,system:masters" > tokens.csv
  )
fi
# The serving certificate, at every start: its addresses depend on the node's network.
(
  cd "$D/pki"
  SANS="IP:127.0.0.1"
  if [ "$NODE" = 1 ]; then SANS="$SANS,IP:$BIND_IP,IP:$NODE_IP"; fi
  openssl req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
  cat > ext.cnf <<EOF
subjectAltName=$SANS,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
basicConstraints=CA:FALSE
keyUsage=digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
EOF
  openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out apiserver.crt -days 3650 -extfile ext.cnf 2>/dev/null
)
TOKEN=$(cut -d, -f1 "$D/pki/tokens.csv")
(
  umask 077   # holds a cluster-admin token
  cat > "$D/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: pagoda-e2e
  cluster:
    server: $SERVER
    certificate-authority: $D/pki/ca.crt
users:
- name: admin
  user:
    token: $TOKEN
contexts:
- name: pagoda-e2e
  context: {cluster: pagoda-e2e, user: admin, namespace: default}
current-context: pagoda-e2e
EOF
)
cat > "$D/cluster.env" <<EOF
SERVER=$SERVER
API_PORT=$API_PORT
ETCD_PORT=$ETCD_PORT
CM_PORT=$CM_PORT
SCHED_PORT=$SCHED_PORT
KUBECONFIG=$D/admin.kubeconfig
BIN=$BIN
STATE_DIR=$D
NODE=$NODE
EOF
say "state dir $D, server $SERVER"

# start NAME CMD...: run a component in the background, logging to logs/NAME.log, and
# record its PID so stop-cluster.sh can stop exactly this process and nothing else.
start() {
  local name=$1; shift
  "$@" > "$D/logs/$name.log" 2>&1 &
  echo $! > "$D/$name.pid"
}
alive() { kill -0 "$(cat "$D/$1.pid")" 2>/dev/null; }
# wait_until NAME TIMEOUT_S CMD...: poll CMD every 0.1 s; give up if NAME died or time ran out.
wait_until() {
  local name=$1 timeout=$2 i; shift 2
  for ((i = 0; i < timeout * 10; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    alive "$name" || fail "$name exited during start-up" "$D/logs/$name.log"
    sleep 0.1
  done
  fail "$name not healthy after ${timeout}s" "$D/logs/$name.log"
}

# ---- etcd ----------------------------------------------------------------------------
# --unsafe-no-fsync: test data need not survive a crash, and fsync dominates latency.
start etcd etcd --name pagoda-e2e --data-dir "$D/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "pagoda-e2e=http://127.0.0.1:$ETCD_PEER_PORT" \
  --listen-metrics-urls "http://127.0.0.1:$ETCD_METRICS_PORT" \
  --unsafe-no-fsync --quota-backend-bytes=2147483648
wait_until etcd 20 curl -sf "http://127.0.0.1:$ETCD_PORT/health"
say "etcd healthy on 127.0.0.1:$ETCD_PORT"

# ---- kube-apiserver ------------------------------------------------------------------
# ServiceAccount admission needs the token controller (controller-manager); without the
# controllers it would reject every pod, so it is only on when they run.
ADMISSION=NamespaceLifecycle,LimitRanger,DefaultStorageClass,ResourceQuota,MutatingAdmissionWebhook,ValidatingAdmissionWebhook
if [ "$CONTROLLERS" = 1 ]; then ADMISSION_FLAGS=(--enable-admission-plugins="$ADMISSION,ServiceAccount")
else ADMISSION_FLAGS=(--enable-admission-plugins="$ADMISSION" --disable-admission-plugins=ServiceAccount); fi
# --insecure-port=0: 1.20 would otherwise also serve unauthenticated HTTP on 8080.
# --endpoint-reconciler-type=none: the `kubernetes` Service would get 127.0.0.1 as its
#   endpoint, which Endpoints validation rejects (loopback) and logs as an error forever.
# --enable-aggregator-routing: webhooks referenced by Service (the chart's admission webhook)
#   are called at an endpoint (pod) IP, which this host reaches; nothing here routes ClusterIPs.
start kube-apiserver "$BIN/kube-apiserver" \
  --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
  --bind-address="$BIND_IP" --advertise-address="$BIND_IP" --secure-port="$API_PORT" --insecure-port=0 \
  --tls-cert-file="$D/pki/apiserver.crt" --tls-private-key-file="$D/pki/apiserver.key" --client-ca-file="$D/pki/ca.crt" \
  --token-auth-file="$D/pki/tokens.csv" --authorization-mode=RBAC \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$D/pki/sa.pub" --service-account-signing-key-file="$D/pki/sa.key" \
  --service-cluster-ip-range="$SERVICE_CIDR" --allow-privileged=true \
  --endpoint-reconciler-type=none --enable-aggregator-routing=true \
  --kubelet-client-certificate="$D/pki/kubelet-client.crt" --kubelet-client-key="$D/pki/kubelet-client.key" \
  --kubelet-preferred-address-types=InternalIP \
  "${ADMISSION_FLAGS[@]}" \
  --cert-dir="$D/pki/generated"
api_ready() { curl -sf --cacert "$D/pki/ca.crt" -H "Authorization: Bearer $TOKEN" "$SERVER/readyz"; }
wait_until kube-apiserver 60 api_ready
say "kube-apiserver ready at $SERVER"

# ---- controllers and scheduler -------------------------------------------------------
if [ "$CONTROLLERS" = 1 ]; then
  # Controllers left out: nodelifecycle (a fake node sends no heartbeats; it would be
  # tainted and its pods evicted), nodeipam/route/service/cloud-node-lifecycle (no cloud, no
  # pod network), ttl (nothing to tune).
  start kube-controller-manager "$BIN/kube-controller-manager" \
    --kubeconfig="$D/admin.kubeconfig" \
    --authentication-kubeconfig="$D/admin.kubeconfig" --authorization-kubeconfig="$D/admin.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$CM_PORT" \
    --cert-dir="$D/pki/generated-cm" \
    --service-account-private-key-file="$D/pki/sa.key" --root-ca-file="$D/pki/ca.crt" \
    --use-service-account-credentials=false \
    --controllers='*,-nodeipam,-nodelifecycle,-ttl,-route,-service,-cloud-node-lifecycle' \
    ${CONTROLLER_QPS_FLAGS[@]+"${CONTROLLER_QPS_FLAGS[@]}"}
  start kube-scheduler "$BIN/kube-scheduler" \
    --kubeconfig="$D/admin.kubeconfig" \
    --authentication-kubeconfig="$D/admin.kubeconfig" --authorization-kubeconfig="$D/admin.kubeconfig" \
    --leader-elect=false --bind-address=127.0.0.1 --port=0 --secure-port="$SCHED_PORT" \
    --cert-dir="$D/pki/generated-scheduler" \
    ${CONTROLLER_QPS_FLAGS[@]+"${CONTROLLER_QPS_FLAGS[@]}"}
  wait_until kube-controller-manager 30 curl -sfk "https://127.0.0.1:$CM_PORT/healthz"
  wait_until kube-scheduler 30 curl -sfk "https://127.0.0.1:$SCHED_PORT/healthz"
  # Pods are rejected until their namespace's `default` ServiceAccount exists; wait for the
  # one in `default` so that the cluster is usable the moment this script returns.
  sa_ready() { curl -sf --cacert "$D/pki/ca.crt" -H "Authorization: Bearer $TOKEN" "$SERVER/api/v1/namespaces/default/serviceaccounts/default"; }
  wait_until kube-controller-manager 30 sa_ready
  say "kube-controller-manager and kube-scheduler healthy"
fi

# ---- the real node -----------------------------------------------------------------
if [ "$NODE" = 1 ]; then
  "$HERE/node.sh" up "$D" || fail "the node did not come up" "$D/logs/kubelet.log"
fi

# ---- watchdog ------------------------------------------------------------------------
if [ -n "${PAGODA_K8S_OWNER_PID:-}" ]; then
  # A test run killed with SIGKILL (CI timeout) cannot run its teardown; this stops the
  # cluster once the owner is gone. setsid: not killed with our process group.
  # shellcheck disable=SC2016  # $1..$3 are the inner script's arguments
  setsid bash -c 'while kill -0 "$1" 2>/dev/null; do sleep 2; done; rm -f "$2/watchdog.pid"; exec "$3" "$2"' \
    watchdog "$PAGODA_K8S_OWNER_PID" "$D" "$HERE/stop-cluster.sh" > "$D/logs/watchdog.log" 2>&1 < /dev/null &
  echo $! > "$D/watchdog.pid"
fi

say "cluster up; export KUBECONFIG=$D/admin.kubeconfig"
