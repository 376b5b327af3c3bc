#!/usr/bin/env bash
# quickstart.sh (`make quickstart`): from a fresh clone to an answer from a model that the
# operator serves on a local Kubernetes cluster with a real kubelet and real containers.
#
#   1 installs Pagoda into .venv                          (make setup)
#   2 Kubernetes binaries, kubelet, the node's packages   (e2e/cluster/ensure-k8s.sh --with-kubelet)
#   3 the image pieces: Debian base, Python dependencies  (e2e/image/build-images.sh --prepare-only)
#     (when 2 has to build, it runs in the background beside 1 and 3)
#   4 starts the cluster: etcd, API server, controllers, scheduler, dockerd, kubelet
#                                                         (e2e/cluster/start-cluster.sh, PAGODA_K8S_NODE=1)
#   5 the images into the node's docker, a tiny random Qwen3 on the node's disk
#   6 installs the Helm chart, applies examples/quickstart-inferenceservice.yaml, waits for Ready
#   7 asks the model through the openai client, prints the answer, `kubectl get pisvc`, what next
#
# The cluster stays up: `make quickstart-down` (this script with `down`) stops it. Running the
# quickstart again reuses a cluster that is up, and every cached piece (~/.cache/pagoda).
# Each stage writes its own log; a failure names the stage, its log and shows the log's end.
#
# Usage: e2e/quickstart.sh [up|down|status]
# Environment: PAGODA_QUICKSTART_DIR (default /tmp/pagoda-quickstart: cluster state and logs),
# PAGODA_CACHE (default ~/.cache/pagoda). Needs root: apt-get, dockerd, kubelet, a bridge.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=e2e/lib.sh
. "$HERE/lib.sh"
REPO=$(cd "$HERE/.." && pwd)
QS=${PAGODA_QUICKSTART_DIR:-/tmp/pagoda-quickstart}
STATE=$QS/cluster
LOGS=$QS/logs
CACHE=${PAGODA_CACHE:-$HOME/.cache/pagoda}
PY=$REPO/.venv/bin/python
MODEL_DIR=/var/lib/pagoda/models/tiny-qwen3      # examples/quickstart-inferenceservice.yaml names it
EXAMPLE=$REPO/examples/quickstart-inferenceservice.yaml
NAME=tiny-qwen3
NAMESPACE=default
RELEASE=pagoda
RELEASE_NS=pagoda-system
TOTAL=7
export PAGODA_DOCKER_SLOT=quickstart              # images persist in ~/.cache/pagoda/docker/quickstart

start_clock quickstart

# stage N DESCRIPTION LOGNAME CMD...: run one stage with its output in its own log; on failure
# say which stage broke, where its log is, and show the log's end.
stage() {
  local n=$1 desc=$2 log=$LOGS/$3.log t0; shift 3
  t0=$(date +%s)
  echo "[quickstart $n/$TOTAL] $desc ... (log: $log)"
  run_logged "$log" "$@"
  [ "$RUN_RC" = 0 ] || fail_stage "$n" "$desc" "$log" "$RUN_RC"
  echo "[quickstart $n/$TOTAL]   done in $(( $(date +%s) - t0 ))s"
}
fail_stage() {
  echo >&2
  echo "[quickstart] FAILED at stage $1/$TOTAL ($2), exit code $4." >&2
  echo "[quickstart] Log: $3 ; its last 40 lines:" >&2
  log_tail "$3" 40
  echo "[quickstart] Fix what it says and run 'make quickstart' again: finished stages are cached." >&2
  exit 1
}

k8s_bin() { "$REPO/e2e/cluster/ensure-k8s.sh" --print-bin-dir; }
kubectl_path() {
  local bin; bin=$(k8s_bin)
  if [ -x "$bin/kubectl" ]; then echo "$bin/kubectl"; else command -v kubectl; fi
}
kc() { "$(kubectl_path)" --kubeconfig="$STATE/admin.kubeconfig" "$@"; }
cluster_up() {
  [ -f "$STATE/admin.kubeconfig" ] && [ -f "$STATE/kube-apiserver.pid" ] && [ -f "$STATE/kubelet.pid" ] || return 1
  kill -0 "$(cat "$STATE/kube-apiserver.pid")" 2>/dev/null && kill -0 "$(cat "$STATE/kubelet.pid")" 2>/dev/null || return 1
  [ "$(kc get node -o jsonpath='{.items[0].status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

case "${1:-up}" in
  down)
    if [ -d "$STATE" ]; then "$REPO/e2e/cluster/stop-cluster.sh" "$STATE"; else echo "[quickstart] no cluster in $STATE"; fi
    echo "[quickstart] stopped. Cached binaries and images stay in $CACHE; the model in $MODEL_DIR."
    exit 0 ;;
  status)
    if cluster_up; then echo "[quickstart] up: export KUBECONFIG=$STATE/admin.kubeconfig"; kc get pisvc -A; exit 0; fi
    echo "[quickstart] not running"; exit 1 ;;
  up) ;;
  *) echo "usage: $0 [up|down|status]" >&2; exit 2 ;;
esac

[ "$(id -u)" = 0 ] || { echo "[quickstart] needs root (apt-get, dockerd, kubelet, a network bridge); run it as root" >&2; exit 1; }
mkdir -p "$LOGS"
say "Pagoda quickstart: a local Kubernetes cluster with a real kubelet, the operator, and a tiny model on CPU"

# ---- 1-3. Pagoda, Kubernetes binaries, image pieces -----------------------------------------
# Cold, the Go build of Kubernetes (stage 2) takes most of the time and keeps both cores busy,
# while installing Pagoda and making the image pieces are mostly downloads and disk: stage 2
# then runs in the background from the start, beside stages 1 and 3.
K8S_CMD=("$REPO/e2e/cluster/ensure-k8s.sh" --with-kubelet)
IMG_CMD=("$REPO/e2e/image/build-images.sh" --prepare-only)
k8s_pid=""
stop_background() { if [ -n "$k8s_pid" ]; then kill -- "-$k8s_pid" 2>/dev/null || true; fi; }
if ! "${K8S_CMD[@]}" --check >/dev/null 2>&1; then
  echo "[quickstart 2/$TOTAL] Kubernetes binaries, kubelet and the node's Debian packages, in the background (cold: builds from Debian's source, ~5-16 min) ... (log: $LOGS/2-kubernetes.log)"
  t2=$(date +%s)
  setsid bash -c 'exec "$@"' _ "${K8S_CMD[@]}" > "$LOGS/2-kubernetes.log" 2>&1 < /dev/null &
  k8s_pid=$!
  trap stop_background EXIT
fi
stage 1 "installing Pagoda and its Python dependencies into .venv (make setup)" 1-setup \
  make -C "$REPO" --no-print-directory setup
stage 3 "image pieces (Debian base with debootstrap, Python dependencies with pip)" 3-image-pieces \
  env PYTHON="$PY" "${IMG_CMD[@]}"
if [ -n "$k8s_pid" ]; then
  echo "[quickstart 2/$TOTAL] waiting for the Kubernetes build ... (log: $LOGS/2-kubernetes.log)"
  rc=0; wait "$k8s_pid" || rc=$?
  k8s_pid=""
  trap - EXIT
  [ "$rc" = 0 ] || fail_stage 2 "Kubernetes binaries, kubelet and the node's Debian packages" "$LOGS/2-kubernetes.log" "$rc"
  echo "[quickstart 2/$TOTAL]   done in $(( $(date +%s) - t2 ))s (in the background)"
else
  stage 2 "Kubernetes binaries, kubelet and the node's Debian packages: cached" 2-kubernetes "${K8S_CMD[@]}"
fi

# ---- 4. the cluster ------------------------------------------------------------------------
start_cluster() {
  if [ -d "$STATE" ]; then "$REPO/e2e/cluster/stop-cluster.sh" "$STATE" || true; rm -rf "$STATE"; fi
  PAGODA_K8S_NODE=1 "$REPO/e2e/cluster/start-cluster.sh" "$STATE"
}
if cluster_up; then
  echo "[quickstart 4/$TOTAL] local cluster: already up ($STATE), reusing it"
else
  stage 4 "starting the local cluster: etcd, API server, controllers, scheduler, dockerd, kubelet" 4-cluster start_cluster
fi
# shellcheck disable=SC1091
. "$STATE/docker.env"
# shellcheck disable=SC1091
. "$STATE/node.env"
export DOCKER_HOST

# ---- 5. images and the model ----------------------------------------------------------------
images_and_model() {
  PYTHON=$PY "$REPO/e2e/image/build-images.sh" | tee "$QS/images.env"
  if [ ! -f "$MODEL_DIR/config.json" ]; then
    rm -rf "$MODEL_DIR.tmp"
    mkdir -p "$(dirname "$MODEL_DIR")"
    "$PY" -c 'import sys; from pagoda_daemon.models.tiny import build_tiny_model; build_tiny_model("qwen3", sys.argv[1])' "$MODEL_DIR.tmp"
    # The daemon runs as a non-root user: the weights must be readable by it.
    chmod -R a+rX "$MODEL_DIR.tmp"
    mv "$MODEL_DIR.tmp" "$MODEL_DIR"
  fi
  ls -la "$MODEL_DIR"
}
stage 5 "daemon and operator images into the node's docker (no pulls), tiny random Qwen3 in $MODEL_DIR" 5-images-model images_and_model
# shellcheck disable=SC1091
# shellcheck disable=SC1090  # DAEMON_IMAGE=..., OPERATOR_IMAGE=... as build-images.sh printed them
. <(grep '_IMAGE=' "$QS/images.env")

# ---- 6. chart + InferenceService -----------------------------------------------------------
install_and_apply() {
  local bin; bin=$(k8s_bin)
  "$bin/helm" --kubeconfig="$STATE/admin.kubeconfig" upgrade --install "$RELEASE" "$REPO/charts/pagoda" \
    --namespace "$RELEASE_NS" --create-namespace -f "$REPO/e2e/quickstart/values.yaml" \
    --set-string "image.tag=${OPERATOR_IMAGE#*:}" --set-string "daemonImage.tag=${DAEMON_IMAGE#*:}" --wait --timeout 5m
  # The admission webhook answers once the endpoints controller has listed the operator behind
  # its Service, a moment after helm's --wait: until then the API server refuses the write.
  local i ready=""
  for ((i = 0; i < 30; i++)); do
    kc apply -n "$NAMESPACE" -f "$EXAMPLE" && break
    sleep 2
  done
  [ "$i" -lt 30 ] || { echo "the InferenceService could not be applied (admission webhook unreachable?)"; return 1; }
  for ((i = 0; i < 300; i++)); do
    ready=$(kc get pisvc "$NAME" -n "$NAMESPACE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || true)
    [ "$ready" = True ] && break
    sleep 1
  done
  kc get pisvc,deploy,pods -n "$NAMESPACE" -o wide
  if [ "$ready" != True ]; then
    echo "InferenceService $NAME not Ready after 5 min; its conditions:"
    kc get pisvc "$NAME" -n "$NAMESPACE" -o jsonpath='{range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}'
    kc describe pods -n "$NAMESPACE" -l "pagoda.dev/inferenceservice=$NAME" | tail -40
    return 1
  fi
}
stage 6 "installing the Helm chart ($RELEASE in $RELEASE_NS), applying $(basename "$EXAMPLE"), waiting for Ready" \
  6-install install_and_apply

# ---- 7. ask it -------------------------------------------------------------------------------
ENDPOINT=$(kc get endpoints "$NAME" -n "$NAMESPACE" -o jsonpath='{.subsets[0].addresses[0].ip}'):8000
ask() {
  "$PY" - "http://$ENDPOINT/v1" "$NAME" <<'PY'
import sys

import openai

base_url, model = sys.argv[1:]
client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=2)
question = "What is paged attention?"
reply = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
)
print(f"question: {question!r}")
print(f"answer:   {reply.choices[0].message.content!r}")
print(f"          ({reply.usage.completion_tokens} tokens, finish_reason={reply.choices[0].finish_reason}; "
      "random weights: the text is noise by design, the serving path is the real one)")
PY
}
stage 7 "POST /v1/chat/completions to the daemon at $ENDPOINT through the openai client" 7-ask ask

echo
sed 's/^/  /' "$LOGS/7-ask.log"
echo
kc get pisvc -n "$NAMESPACE" | sed 's/^/  /'
KUBECTL=$(kubectl_path)
cat <<EOF

Done in $(elapsed). The cluster keeps running. Where to look next:
  export KUBECONFIG=$STATE/admin.kubeconfig
  alias kubectl=$KUBECTL        # or any kubectl; this cluster is Kubernetes 1.20
  kubectl get pisvc,deploy,pods -o wide              # the InferenceService and what the operator made
  kubectl describe pisvc $NAME                       # conditions, placement
  kubectl logs deploy/$NAME                          # the daemon
  kubectl -n $RELEASE_NS logs deploy/$RELEASE-operator   # the operator
  kubectl get ntopo $NODE_NAME -o yaml               # the node's topology, from the chart's agent
  kubectl scale pisvc/$NAME --replicas=2             # a second replica
  curl http://$ENDPOINT/metrics                      # pod IPs ($POD_CIDR) are reachable from this machine only
  docker -H $DOCKER_HOST ps                          # the node's containers
  logs: $LOGS (stages), $STATE/logs (components)
Tear down: make quickstart-down
EOF
