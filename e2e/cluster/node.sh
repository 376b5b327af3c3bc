#!/usr/bin/env bash
# node.sh: a real Kubernetes node on this machine, for a cluster that start-cluster.sh runs
# with PAGODA_K8S_NODE=1: Debian's docker daemon (its own socket, exec root and data root),
# a pause image built from Kubernetes' pause.c, a kubelet (v1.20 dockershim) and a CNI bridge
# that gives every pod its own IP, reachable from this machine only.
#
#   node.sh net-up STATE_DIR   pick a free network id N, create the bridge (before the API server
#                              starts: it listens on an address of that bridge); writes node.env
#   node.sh up STATE_DIR       start dockerd and the kubelet, wait for the node to be Ready
#   node.sh down STATE_DIR     stop them, remove the pods' containers, unmount the pods' volumes,
#                              delete the bridge (stop-cluster.sh calls this)
#
# Network (docs/testing.md, "The real node"): bridge pagoda-kN holds
#   10.244.N.1/24  the node's IP (kubelet --node-ip, its API on :10250) and the pods' gateway;
#                  pods get 10.244.N.10-254 from the host-local IPAM, routed to this host only
#   10.96.N.1/32   the ClusterIP of the `kubernetes` Service (service range 10.96.N.0/24): the API
#                  server listens right there on :443, so in-cluster clients (the operator, the
#                  topology agent, the daemon) reach it the standard way without kube-proxy.
# No iptables rule, no NAT, no change to ip_forward (0 stays 0: a pod can reach this machine
# and other pods, nothing beyond). Other Services' ClusterIPs are not routed (no kube-proxy):
# talk to pod IPs, e.g. from the Service's Endpoints.
#
# Mounts: dockerd and the kubelet share a mount namespace of their own (a slave of this
# machine's; kept in RUN_DIR/mnt). The kubelet's volume mounts (secrets, configmaps, memory
# emptyDirs) and docker's overlay mounts live there and vanish with it, and /var/log/pods and
# /var/log/containers (paths the kubelet 1.20 hard-codes, and where it deletes what it does not
# know) are the state dir's own, so two nodes on one machine never touch each other's logs.
#
# Host settings: none change. The kubelet is built not to rewrite kernel settings
# (ensure-k8s.sh patch_kubelet) and told not to make iptables chains (makeIPTablesUtilChains);
# dockerd gets no bridge, iptables or ip_forward, and a read-only kernel/keys.
#
# Environment:
#   PAGODA_CACHE         cache root (default ~/.cache/pagoda)
#   PAGODA_DOCKER_SLOT   name of the persistent docker data root under $PAGODA_CACHE/docker/
#                        (default "default"; quickstart uses "quickstart", the e2e tests "e2e").
#                        Images survive between runs there. A slot serves one dockerd at a time
#                        (a lock); when it is busy, SLOT-2 .. SLOT-4 are tried.
#   PAGODA_NODE_NAME     the Node's name (default pagoda-node)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=e2e/lib.sh
. "$HERE/../lib.sh"
CMD=${1:-}
D=${2:-${PAGODA_K8S_STATE:-/tmp/pagoda-k8s-$(id -u)}}
mkdir -p "$D"
D=$(cd "$D" && pwd)
CACHE=${PAGODA_CACHE:-$HOME/.cache/pagoda}
RUN_ROOT=/run/pagoda-k8s        # short: unix socket paths are limited to 107 bytes
PAUSE_IMAGE=pagoda.local/pause:3.4.1
CNI_BIN=${PAGODA_CNI_BIN:-/usr/lib/cni}

start_clock node

# ---- net-up ----------------------------------------------------------------------------
net_up() {
  command -v ip >/dev/null || die "ip (iproute2) not found"
  [ "$(id -u)" = 0 ] || die "a real node needs root (bridge, dockerd, kubelet)"
  mkdir -p "$RUN_ROOT"
  exec 8>"$RUN_ROOT/.net.lock"
  flock 8
  local n=""
  for i in $(seq 1 250); do
    ip link show "pagoda-k$i" >/dev/null 2>&1 && continue
    # Skip a subnet this machine already uses for anything else.
    if ip -4 -o addr show | grep -qE " (10\.244\.$i\.|10\.96\.$i\.)"; then continue; fi
    if ip -4 route show | grep -qE "^(10\.244\.$i\.|10\.96\.$i\.)"; then continue; fi
    n=$i; break
  done
  [ -n "$n" ] || die "no free network id (bridges pagoda-k1..250 all exist?)"
  local br=pagoda-k$n
  # A fixed MAC address: a Linux bridge created without one takes the lowest MAC of its ports and
  # changes it as pods' veths come and go. The pods' ARP entries for the gateway then point at a
  # MAC nobody answers for, and replies to this machine (the API server calling the admission
  # webhook) are lost until those entries expire, 15-45 s later: that was a flaky e2e failure
  # ("failed calling webhook ... dial tcp 10.244.N.10:9443: i/o timeout") right after pods were
  # deleted. Locally administered (02:...), one per network id.
  ip link add "$br" address "$(printf '02:70:67:64:%02x:01' "$n")" type bridge
  ip addr add "10.244.$n.1/24" dev "$br"
  ip addr add "10.96.$n.1/32" dev "$br"
  ip link set "$br" up
  exec 8>&-
  cat > "$D/node.env" <<EOF
NET_ID=$n
BRIDGE=$br
NODE_IP=10.244.$n.1
POD_CIDR=10.244.$n.0/24
SERVICE_CIDR=10.96.$n.0/24
API_IP=10.96.$n.1
RUN_DIR=$RUN_ROOT/$n
NODE_NAME=${PAGODA_NODE_NAME:-pagoda-node}
EOF
  say "bridge $br: node IP 10.244.$n.1, pods 10.244.$n.0/24, kubernetes Service 10.96.$n.1:443"
}

# ---- up --------------------------------------------------------------------------------
up() {
  [ -f "$D/node.env" ] || die "$D/node.env missing: start the cluster with PAGODA_K8S_NODE=1 (it runs node.sh net-up)"
  [ -f "$D/cluster.env" ] || die "$D/cluster.env missing: start-cluster.sh has not run in $D"
  # shellcheck disable=SC1091
  . "$D/node.env"
  # shellcheck disable=SC1091
  . "$D/cluster.env"
  for b in dockerd runc jq socat nsenter; do command -v "$b" >/dev/null || die "$b not found: run e2e/cluster/ensure-k8s.sh --with-kubelet"; done
  [ -x "$BIN/kubelet" ] || die "$BIN/kubelet missing: run e2e/cluster/ensure-k8s.sh --with-kubelet"
  [ -x "$BIN/pause" ] || die "$BIN/pause missing: run e2e/cluster/ensure-k8s.sh --with-kubelet"
  local plugin
  for plugin in bridge host-local loopback; do
    [ -x "$CNI_BIN/$plugin" ] || die "CNI plugin $CNI_BIN/$plugin missing (Debian containernetworking-plugins)"
  done
  # The kubelet makes unix sockets under its root dir (device-plugins/kubelet.sock, ...); their
  # paths must stay below the 107-byte limit.
  [ "${#D}" -le 64 ] || die "state dir path $D is longer than 64 characters: the kubelet's sockets under it would be too long"
  mkdir -p "$RUN_DIR" "$D/logs" "$D/docker"
  local sock=$RUN_DIR/docker.sock

  # -- the node's mount namespace (see the header) ------------------------------------------
  local ns=$RUN_DIR/mnt
  if ! mountpoint -q "$RUN_DIR"; then
    # A namespace file must be bind-mounted on a private mount (util-linux's recipe).
    mount --bind "$RUN_DIR" "$RUN_DIR"
    mount --make-private "$RUN_DIR"
  fi
  if ! mountpoint -q "$ns"; then
    touch "$ns"
    mkdir -p /var/log/pods /var/log/containers "$D/pod-logs" "$D/container-logs"
    # dockerd raises kernel.keys.root_maxkeys/root_maxbytes at start-up (only a warning when it
    # cannot): a read-only view of them in this namespace keeps this machine's values.
    # shellcheck disable=SC2016  # $1, $2 belong to the inner sh
    unshare --mount="$ns" --propagation slave sh -c '
      mount --bind "$1" /var/log/pods && mount --bind "$2" /var/log/containers &&
      mount --bind /proc/sys/kernel/keys /proc/sys/kernel/keys &&
      mount -o remount,bind,ro /proc/sys/kernel/keys' _ "$D/pod-logs" "$D/container-logs" \
      || die "could not make the node's mount namespace"
  fi
  local in_ns=(nsenter --mount="$ns" --)

  # -- docker daemon: its own everything, no bridge, no iptables, no ip_forward ------------
  local slot=${PAGODA_DOCKER_SLOT:-default} root="" lock s
  mkdir -p "$CACHE/docker"
  for s in "$slot" "$slot-2" "$slot-3" "$slot-4"; do
    lock=$CACHE/docker/$s.lock
    exec 9>"$lock"
    if flock -n 9; then root=$CACHE/docker/$s; break; fi
    exec 9>&-
  done
  [ -n "$root" ] || die "docker data roots $CACHE/docker/$slot{,-2,-3,-4} are all in use"
  echo '{}' > "$D/docker/daemon.json"
  # dockerd inherits fd 9 and so holds the slot's lock for as long as it runs.
  "${in_ns[@]}" dockerd --config-file="$D/docker/daemon.json" --pidfile="$D/docker/dockerd.pid" \
    --host="unix://$sock" --data-root="$root" --exec-root="$RUN_DIR/exec" \
    --bridge=none --iptables=false --ip6tables=false --ip-masq=false --ip-forward=false \
    --userland-proxy=false --live-restore=false --storage-driver=overlay2 \
    --log-driver=json-file --log-opt=max-size=10m --log-opt=max-file=2 \
    --exec-opt=native.cgroupdriver=cgroupfs \
    --add-runtime="localrunc=$HERE/runc-wrap" --default-runtime=localrunc \
    > "$D/logs/dockerd.log" 2>&1 &
  echo $! > "$D/dockerd.pid"
  exec 9>&-
  echo "DOCKER_HOST=unix://$sock" > "$D/docker.env"
  echo "DOCKER_ROOT=$root" >> "$D/docker.env"
  local i
  for ((i = 0; i < 300; i++)); do
    docker -H "unix://$sock" version >/dev/null 2>&1 && break
    kill -0 "$(cat "$D/dockerd.pid")" 2>/dev/null || die "dockerd exited during start-up" "$D/logs/dockerd.log"
    sleep 0.1
  done
  docker -H "unix://$sock" version >/dev/null 2>&1 || die "dockerd not answering on $sock after 30 s" "$D/logs/dockerd.log"
  say "dockerd up: socket $sock, data root $root"
  # Pods of an earlier run in this data root (their kubelet is gone): remove them.
  local stale
  stale=$(docker -H "unix://$sock" ps -aq --filter label=io.kubernetes.docker.type)
  if [ -n "$stale" ]; then
    # shellcheck disable=SC2086
    docker -H "unix://$sock" rm -f $stale >/dev/null 2>&1 || true
    say "removed $(echo "$stale" | wc -w) containers left over from an earlier run"
  fi
  # -- pause image: the static pause binary built by ensure-k8s.sh -------------------------
  if ! docker -H "unix://$sock" image inspect "$PAUSE_IMAGE" >/dev/null 2>&1; then
    tar -C "$BIN" -c pause | docker -H "unix://$sock" import -c 'ENTRYPOINT ["/pause"]' - "$PAUSE_IMAGE" >/dev/null
    say "imported $PAUSE_IMAGE"
  fi
  local cgroup_driver
  cgroup_driver=$(docker -H "unix://$sock" info --format '{{.CgroupDriver}}')

  # -- CNI: bridge + host-local IPAM, no gateway changes on the host, no masquerade -------
  mkdir -p "$D/cni/net.d" "$D/cni/cache"
  rm -rf "$D/cni/ipam"
  cat > "$D/cni/net.d/10-pagoda.conflist" <<EOF
{
  "cniVersion": "0.3.1",
  "name": "pagoda",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$BRIDGE",
      "isGateway": false,
      "ipMasq": false,
      "hairpinMode": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$D/cni/ipam",
        "ranges": [[{"subnet": "$POD_CIDR", "gateway": "$NODE_IP", "rangeStart": "${NODE_IP%.1}.10"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    }
  ]
}
EOF

  # -- kubelet -----------------------------------------------------------------------------
  # Client certificate the API server presents to the kubelet (logs, exec, port-forward).
  mkdir -p "$D/kubelet/pki" "$D/kubelet/volume-plugins" "$D/kubelet/dockershim"
  local healthz_port
  healthz_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  cat > "$D/kubelet-config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: $D/pki/ca.crt}
authorization: {mode: AlwaysAllow}
cgroupDriver: $cgroup_driver
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
# A shared development machine: never evict pods or delete images because the disk or memory is
# fuller than a production node would like.
evictionHard: {memory.available: "1Mi", nodefs.available: "1%", imagefs.available: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: ""
serializeImagePulls: false
# Leave this machine's iptables alone: no KUBE-FIREWALL/KUBE-MARK-*/KUBE-POSTROUTING chains (they
# only serve kube-proxy and hostport NAT, and this node has neither).
makeIPTablesUtilChains: false
# Report Ready seconds after start-up rather than after the 10 s default period.
nodeStatusUpdateFrequency: 2s
# A changed ConfigMap reaches its pods' volumes at their next sync: every 10 s here instead of the
# 1 min default, so the tests that follow one into a pod (the P/D proxy's list of prefill pods) wait
# seconds, not minutes. The operator relies on no particular period.
syncFrequency: 10s
maxPods: 50
EOF
  "${in_ns[@]}" "$BIN/kubelet" --config="$D/kubelet-config.yaml" --kubeconfig="$D/admin.kubeconfig" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
    --container-runtime=docker --docker-endpoint="unix://$sock" --pod-infra-container-image="$PAUSE_IMAGE" \
    --network-plugin=cni --cni-bin-dir="$CNI_BIN" --cni-conf-dir="$D/cni/net.d" --cni-cache-dir="$D/cni/cache" \
    --hairpin-mode=none \
    --root-dir="$D/kubelet" --cert-dir="$D/kubelet/pki" --volume-plugin-dir="$D/kubelet/volume-plugins" \
    --experimental-dockershim-root-directory="$D/kubelet/dockershim" \
    --node-labels=pagoda.dev/local-node=true \
    > "$D/logs/kubelet.log" 2>&1 &
  echo $! > "$D/kubelet.pid"
  echo "KUBELET_HEALTHZ=http://127.0.0.1:$healthz_port/healthz" >> "$D/docker.env"

  # -- wait for the node ------------------------------------------------------------------
  local k=("$BIN/kubectl" --kubeconfig="$D/admin.kubeconfig")
  command -v "${k[0]}" >/dev/null 2>&1 || k=(kubectl --kubeconfig="$D/admin.kubeconfig")
  local ready=""
  for ((i = 0; i < 600; i++)); do
    kill -0 "$(cat "$D/kubelet.pid")" 2>/dev/null || die "kubelet exited during start-up" "$D/logs/kubelet.log"
    ready=$("${k[@]}" get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null || true)
    [ "$ready" = True ] && break
    sleep 0.1
  done
  [ "$ready" = True ] || die "node $NODE_NAME not Ready after 60 s" "$D/logs/kubelet.log"
  # The node-lifecycle controller is off (start-cluster.sh), so nobody lifts the taints the
  # kubelet registers with; lift them once.
  local taint
  for taint in $("${k[@]}" get node "$NODE_NAME" -o jsonpath='{range .spec.taints[*]}{.key}:{.effect}{" "}{end}'); do
    case "$taint" in node.kubernetes.io/*) "${k[@]}" taint node "$NODE_NAME" "$taint-" >/dev/null ;; esac
  done
  say "node $NODE_NAME Ready (IP $NODE_IP, cgroup driver $cgroup_driver)"
}

# ---- down ------------------------------------------------------------------------------
# kill_pidfile NAME FILE TIMEOUT_S: stop a process we started, by its recorded PID, only if its
# command line still mentions this state dir (a recycled PID is never touched).
kill_pidfile() {
  local name=$1 file=$2 timeout=$3 pid i
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  rm -f "$file"
  if [ -z "$pid" ] || ! [ -r "/proc/$pid/cmdline" ] || ! tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qF -- "$D"; then
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || return 0
  for ((i = 0; i < timeout * 10; i++)); do kill -0 "$pid" 2>/dev/null || { say "stopped $name"; return 0; }; sleep 0.1; done
  echo "[node] $name ($pid) ignored SIGTERM for ${timeout}s; SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

down() {
  [ -f "$D/node.env" ] || return 0
  # shellcheck disable=SC1091
  . "$D/node.env"
  kill_pidfile kubelet "$D/kubelet.pid" 10
  local sock=$RUN_DIR/docker.sock
  if [ -f "$D/dockerd.pid" ] && [ -S "$sock" ]; then
    # The pods' containers first: their network namespaces (and veths) and mounts go with them.
    local ids
    ids=$(timeout 20 docker -H "unix://$sock" ps -aq --filter label=io.kubernetes.docker.type 2>/dev/null || true)
    # shellcheck disable=SC2086
    [ -z "$ids" ] || timeout 60 docker -H "unix://$sock" rm -f $ids >/dev/null 2>&1 || true
  fi
  kill_pidfile dockerd "$D/dockerd.pid" 20
  # Volumes the kubelet mounted live in the node's mount namespace; should any be in this one
  # (a node started by an older node.sh), unmount them, deepest first.
  local m
  while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done < <(awk -v p="$D/kubelet" -v r="$RUN_DIR/exec" '$2 == p || index($2, p "/") == 1 || index($2, r "/") == 1 { print $2 }' \
             /proc/self/mounts | sort -r)
  if ip link show "$BRIDGE" >/dev/null 2>&1; then ip link del "$BRIDGE" && say "deleted bridge $BRIDGE"; fi
  # The mount namespace goes with its last process once its file is unmounted.
  if mountpoint -q "$RUN_DIR/mnt"; then umount "$RUN_DIR/mnt" || umount -l "$RUN_DIR/mnt" || true; fi
  if mountpoint -q "$RUN_DIR"; then umount "$RUN_DIR" || umount -l "$RUN_DIR" || true; fi
  rm -rf "$RUN_DIR" "$D/cni/ipam"
  rm -f "$D/node.env"
}

case "$CMD" in
  net-up) net_up ;;
  up) up ;;
  down) down ;;
  *) echo "usage: node.sh net-up|up|down STATE_DIR" >&2; exit 2 ;;
esac
