#!/usr/bin/env bash
# stop-cluster.sh: stop what start-cluster.sh (and fake kubelets started with a pid file in
# the same state dir) started, by the PIDs recorded in the state dir. A real node
# (PAGODA_K8S_NODE=1) goes first: kubelet, the pods' containers, dockerd, the pods' mounts and
# the bridge (node.sh down).
#
# Usage: stop-cluster.sh [STATE_DIR]       (or PAGODA_K8S_STATE; default /tmp/pagoda-k8s-$UID)
# The state dir itself (logs, certs, etcd data) is left for post-mortems; delete it yourself.
set -euo pipefail

D=${1:-${PAGODA_K8S_STATE:-/tmp/pagoda-k8s-$(id -u)}}
[ -d "$D" ] || { echo "[stop-cluster] no state dir $D; nothing to stop"; exit 0; }
D=$(cd "$D" && pwd)
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# The watchdog first: it would otherwise run this script a second time.
if [ -f "$D/watchdog.pid" ]; then
  wpid=$(cat "$D/watchdog.pid")
  if [ -r "/proc/$wpid/cmdline" ] && tr '\0' ' ' < "/proc/$wpid/cmdline" | grep -qF -- "$D"; then
    kill -TERM "$wpid" 2>/dev/null || true
  fi
  rm -f "$D/watchdog.pid"
fi
if [ -f "$D/node.env" ]; then "$HERE/node.sh" down "$D" || echo "[stop-cluster] node.sh down failed; continuing"; fi

# Collect the PIDs to stop. A PID is only used if its command line still mentions this
# state dir: after a reboot or a long time the number may belong to an unrelated process,
# which we must never touch.
NAMES=() PIDS=()
collect() {
  local name=$1 pidfile=$D/$1.pid pid
  [ -f "$pidfile" ] || return 0
  pid=$(cat "$pidfile")
  if [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] && tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$D"; then
    NAMES+=("$name"); PIDS+=("$pid")
  fi
  rm -f "$pidfile"
}
for f in "$D"/fake-kubelet-*.pid; do
  if [ -e "$f" ]; then collect "$(basename "$f" .pid)"; fi
done
for c in kube-scheduler kube-controller-manager kube-apiserver etcd; do collect "$c"; done
[ "${#PIDS[@]}" != 0 ] || { echo "[stop-cluster] nothing running from $D"; exit 0; }

# SIGTERM all at once: each component takes 1.5-3 s to shut down gracefully, and one by
# one that added up to ~9 s per test session. Whatever still runs after 5 s gets SIGKILL;
# the cluster's data is disposable.
kill -TERM "${PIDS[@]}" 2>/dev/null || true
for ((i = 0; i < 50; i++)); do
  alive=0
  for pid in "${PIDS[@]}"; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
  [ "$alive" = 1 ] || break
  sleep 0.1
done
for j in "${!PIDS[@]}"; do
  if kill -0 "${PIDS[$j]}" 2>/dev/null; then
    echo "[stop-cluster] ${NAMES[$j]} (${PIDS[$j]}) ignored SIGTERM for 5 s; SIGKILL"
    kill -KILL "${PIDS[$j]}" 2>/dev/null || true
  fi
done
echo "[stop-cluster] stopped ${NAMES[*]}"
