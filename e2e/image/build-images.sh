#!/usr/bin/env bash
# build-images.sh: the local Pagoda images, built with no image pull.
#
#   pagoda-daemon:<hash> (+ :dev)    `pagoda serve` and `pagoda topology` (the daemon extra, torch CPU)
#   pagoda-operator:<hash> (+ :dev)  `pagoda operator` (the operator extra only: no torch)
#
# No registry these machines reach serves base images, so every layer is assembled here:
#
#   pagoda-base        Debian bookworm minbase + python3 from the Debian mirror apt already uses
#                      (debootstrap), a non-root user `pagoda` (uid/gid 10001)
#   *-deps             the extra's Python dependencies, installed by this machine's pip (same
#                      Python 3.11 ABI; its index/find-links config, e.g. the local torch CPU
#                      wheel, applies) with --target into /usr/local/lib/python3.11/dist-packages
#   the image          the project itself (a wheel of this tree, --no-deps), the `pagoda`
#                      entrypoint, labels, USER pagoda
#
# Each piece is cached under ${PAGODA_CACHE:-~/.cache/pagoda}/images/, keyed by a hash of what
# it is made from: the base by its recipe, the deps by pyproject's extras and the torch pin,
# the project layer by the content of daemon/, operator/, kernels/, pyproject.toml, README.md
# and this script.
# A source change rebuilds only the last, small layer (seconds); nothing is rebuilt when nothing
# changed. Images go into the docker daemon of DOCKER_HOST (a node's dockerd, see
# e2e/cluster/node.sh); a tag that already exists there is not built again.
#
# Usage: build-images.sh [--prepare-only] [--check] [--print-tags]
#   --prepare-only   only the cached pieces on this machine (no docker daemon needed)
#   --check          build nothing; exit 0 when the slow pieces (base, dependencies) are cached
#   --print-tags     print DAEMON_IMAGE=... and OPERATOR_IMAGE=... (the content-hash tags) and exit
# Environment: DOCKER_HOST (required unless --prepare-only), PYTHON (default: the repo's
# .venv/bin/python, whose pip installs the dependencies), TORCH (default torch==2.13.0),
# DEBIAN_MIRROR (default: the first Debian URI in /etc/apt), PAGODA_CACHE.
# Needs root (debootstrap) the first time. Logs of each step: $CACHE/images/logs/.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib.sh
. "$HERE/../lib.sh"
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${PAGODA_CACHE:-$HOME/.cache/pagoda}
IMG=$CACHE/images
LOGS=$IMG/logs
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
TORCH=${TORCH:-torch==2.13.0}
SUITE=bookworm
PYVER=3.11
SITE=/usr/local/lib/python$PYVER/dist-packages
UID_GID=10001
# What the base is made of; changing this text changes the base's key (and so every image).
BASE_RECIPE="debootstrap --variant=minbase $SUITE; include python3 ca-certificates tzdata; users pagoda $UID_GID, nonroot 65532; v2"

PREPARE_ONLY=0 PRINT_TAGS=0 CHECK=0
for arg in "$@"; do
  case "$arg" in
    --prepare-only) PREPARE_ONLY=1 ;;
    --check) CHECK=1 ;;
    --print-tags) PRINT_TAGS=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; /shellcheck/d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-images: unknown argument: $arg (try --help)" >&2; exit 2 ;;
  esac
done

start_clock build-images

[ -x "$PYTHON" ] || die "no Python at $PYTHON: run 'make setup' first (or set PYTHON)"

# ---- keys ------------------------------------------------------------------------------
# One Python call computes every key: extras come from pyproject.toml, the project hash from
# the files that go into the wheel.
read -r KEY_BASE KEY_DDEPS KEY_ODEPS KEY_PROJECT < <("$PYTHON" - "$REPO" "$BASE_RECIPE" "$TORCH" <<'PY'
import hashlib, os, sys, tomllib
repo, recipe, torch = sys.argv[1:]
def h(*parts):
    d = hashlib.sha256()
    for p in parts:
        d.update(p if isinstance(p, bytes) else p.encode())
        d.update(b"\0")
    return d.hexdigest()[:12]
meta = tomllib.load(open(os.path.join(repo, "pyproject.toml"), "rb"))["project"]
extras = meta["optional-dependencies"]
base = h(recipe)
ddeps = h(base, torch, *meta["dependencies"], *extras["daemon"])
odeps = h(base, *meta["dependencies"], *extras["operator"])
files = []
for top in ("daemon", "operator", "kernels"):
    for root, dirs, names in os.walk(os.path.join(repo, top)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.endswith(".egg-info"))
        files += [os.path.join(root, n) for n in names if not n.endswith((".pyc", ".pyo"))]
# This script too: it writes the entrypoint and the final layers.
files += [os.path.join(repo, f) for f in ("pyproject.toml", "README.md", "e2e/image/build-images.sh")]
parts = []
for f in sorted(files):
    parts += [os.path.relpath(f, repo), open(f, "rb").read()]
print(base, ddeps, odeps, h(*parts))
PY
)
DAEMON_TAG=$(printf '%s' "$KEY_DDEPS-$KEY_PROJECT" | sha256sum | cut -c1-12)
OPERATOR_TAG=$(printf '%s' "$KEY_ODEPS-$KEY_PROJECT" | sha256sum | cut -c1-12)
DAEMON_IMAGE=pagoda-daemon:$DAEMON_TAG
OPERATOR_IMAGE=pagoda-operator:$OPERATOR_TAG
if [ "$PRINT_TAGS" = 1 ]; then
  echo "DAEMON_IMAGE=$DAEMON_IMAGE"
  echo "OPERATOR_IMAGE=$OPERATOR_IMAGE"
  exit 0
fi

BASE_DIR=$IMG/base-$KEY_BASE
DDEPS_DIR=$IMG/daemon-deps-$KEY_DDEPS
ODEPS_DIR=$IMG/operator-deps-$KEY_ODEPS
PROJ_DIR=$IMG/project-$KEY_PROJECT
if [ "$CHECK" = 1 ]; then
  missing=()
  [ -f "$BASE_DIR/rootfs.tar" ] || missing+=("Debian base ($BASE_DIR)")
  [ -d "$DDEPS_DIR/site-packages" ] || missing+=("daemon dependencies ($DDEPS_DIR)")
  [ -d "$ODEPS_DIR/site-packages" ] || missing+=("operator dependencies ($ODEPS_DIR)")
  if [ "${#missing[@]}" = 0 ]; then echo "image pieces cached in $IMG"; exit 0; fi
  echo "missing image pieces: ${missing[*]}"
  exit 1
fi

mkdir -p "$IMG" "$LOGS"
exec 9>"$IMG/.lock"
if ! flock -n 9; then say "another build-images.sh holds $IMG/.lock; waiting"; flock 9; fi

# ---- 1. the Debian base ----------------------------------------------------------------
debian_mirror() {
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }' /etc/apt/sources.list)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}
build_base() {
  command -v debootstrap >/dev/null || {
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=300 update
    apt-get -o DPkg::Lock::Timeout=300 install -y --no-install-recommends debootstrap
  }
  local mirror tmp=$BASE_DIR.tmp
  mirror=$(debian_mirror)
  echo "mirror: $mirror"
  rm -rf "$tmp"
  mkdir -p "$tmp" "$IMG/debs"
  debootstrap --variant=minbase --include=python3,ca-certificates,tzdata --cache-dir="$IMG/debs" \
    "$SUITE" "$tmp/rootfs" "$mirror"
  local r=$tmp/rootfs
  # The non-root user the images run as, and distroless' `nonroot` (65532), the uid the chart
  # gives the operator pod, so that whatever asks "who am I" gets an answer.
  echo "pagoda:x:$UID_GID:$UID_GID:pagoda:/home/pagoda:/usr/sbin/nologin" >> "$r/etc/passwd"
  echo "nonroot:x:65532:65532:nonroot:/home/nonroot:/usr/sbin/nologin" >> "$r/etc/passwd"
  printf 'pagoda:x:%s:\nnonroot:x:65532:\n' "$UID_GID" >> "$r/etc/group"
  printf 'pagoda:!:19000::::::\nnonroot:!:19000::::::\n' >> "$r/etc/shadow"
  mkdir -p "$r/home/pagoda"
  chown "$UID_GID:$UID_GID" "$r/home/pagoda"
  # Keep copyright files; drop what a server image never reads.
  find "$r/usr/share/doc" -type f ! -name copyright -delete 2>/dev/null || true
  rm -rf "$r/usr/share/man" "$r/usr/share/info" "$r/var/cache/apt/"*.bin "$r/var/lib/apt/lists/"* \
    "$r/var/cache/debconf/"*-old "$r/var/log/"*.log
  "$r/usr/bin/python3" --version 2>/dev/null || true
  tar --numeric-owner -C "$r" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf "$tmp/rootfs.tar" .
  rm -rf "$r"
  rm -rf "$BASE_DIR"
  mv "$tmp" "$BASE_DIR"
  ls -la "$BASE_DIR"
}
[ -f "$BASE_DIR/rootfs.tar" ] || run_step base "Debian $SUITE minbase + python3 with debootstrap (once; ~2 min)" build_base

# ---- 2. Python dependencies ---------------------------------------------------------------
# pip_target DIR REQ...: install into DIR as the image's site-packages, bytecode compiled for
# the image (3.11 everywhere; unchecked-hash pycs stay valid whatever the files' mtimes).
pip_target() {
  local dir=$1 tmp=$1.tmp; shift
  rm -rf "$tmp"
  mkdir -p "$tmp"
  "$PYTHON" -m pip install --no-input --disable-pip-version-check --no-compile --no-warn-script-location \
    --prefer-binary --target "$tmp/site-packages" "$@"
  # Console scripts carry this machine's interpreter path: useless in the image.
  rm -rf "$tmp/site-packages/bin"
  "$PYTHON" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$tmp/site-packages" > /dev/null || true
  du -sh "$tmp/site-packages"
  rm -rf "$dir"
  mv "$tmp" "$dir"
}
extra_reqs() {  # the requirement strings of one extra (plus the base dependencies)
  "$PYTHON" - "$REPO/pyproject.toml" "$1" <<'PY'
import sys, tomllib
meta = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(meta["dependencies"] + meta["optional-dependencies"][sys.argv[2]]))
PY
}
if [ ! -d "$DDEPS_DIR/site-packages" ]; then
  mapfile -t REQS < <(extra_reqs daemon)
  run_step daemon-deps "daemon dependencies ($TORCH + the daemon extra) with pip --target (once per pyproject change; ~2-3 min)" \
    pip_target "$DDEPS_DIR" "$TORCH" "${REQS[@]}"
fi
if [ ! -d "$ODEPS_DIR/site-packages" ]; then
  mapfile -t REQS < <(extra_reqs operator)
  run_step operator-deps "operator dependencies (the operator extra) with pip --target" pip_target "$ODEPS_DIR" "${REQS[@]}"
fi

# ---- 3. the project ---------------------------------------------------------------------
build_project() {
  local tmp=$PROJ_DIR.tmp src
  rm -rf "$tmp"
  mkdir -p "$tmp/bin"
  # Build from a copy, so the wheel build writes nothing (build/, *.egg-info) into the tree.
  src=$(mktemp -d)
  tar -C "$REPO" --exclude=__pycache__ --exclude='*.pyc' --exclude='*.egg-info' \
    -cf - pyproject.toml README.md daemon operator kernels | tar -C "$src" -xf -
  "$PYTHON" -m pip install --no-input --disable-pip-version-check --no-deps --no-build-isolation --no-compile \
    --target "$tmp/site-packages" "$src"
  rm -rf "$src" "$tmp/site-packages/bin"
  "$PYTHON" -m compileall -q -j 0 --invalidation-mode unchecked-hash "$tmp/site-packages" > /dev/null || true
  # What pip's console script would be, for the image's /usr/bin/python3. The __main__ guard
  # matters: the engine starts its process with multiprocessing's spawn, which imports this
  # file again as __mp_main__.
  cat > "$tmp/bin/pagoda" <<EOF
#!/usr/bin/python3
import sys

from pagoda_daemon.cli import main

if __name__ == "__main__":
    sys.exit(main())
EOF
  chmod 755 "$tmp/bin/pagoda"
  rm -rf "$PROJ_DIR"
  mv "$tmp" "$PROJ_DIR"
}
[ -d "$PROJ_DIR/site-packages" ] || run_step project "the project ($KEY_PROJECT) as a wheel, --no-deps" build_project
# Old pieces pile up (a dependency layer is 1.3 GB): keep the newest 2 of each kind (5 project
# layers, a few MB each), so that switching between two branches does not rebuild.
prune() {  # PREFIX KEEP
  local old
  # Newest first, by modification time; *.tmp are half-built pieces of a failed run.
  mapfile -t old < <(find "$IMG" -maxdepth 1 -name "$1-*" ! -name '*.tmp' -printf '%T@ %p\n' | sort -rn | cut -d' ' -f2- | tail -n +"$(( $2 + 1 ))")
  [ "${#old[@]}" = 0 ] || rm -rf "${old[@]}"
}
prune base 2; prune daemon-deps 2; prune operator-deps 2; prune project 5

if [ "$PREPARE_ONLY" = 1 ]; then
  say "prepared in $IMG (base $KEY_BASE, daemon deps $KEY_DDEPS, operator deps $KEY_ODEPS, project $KEY_PROJECT)"
  exit 0
fi

# ---- 4. docker images -------------------------------------------------------------------
[ -n "${DOCKER_HOST:-}" ] || die "DOCKER_HOST is not set (the node's dockerd: see e2e/cluster/node.sh, docker.env)"
DOCKER=${DOCKER:-docker}
# The classic builder: BuildKit would want a buildx plugin, and nothing here needs it.
export DOCKER_BUILDKIT=0
has_image() { "$DOCKER" image inspect "$1" >/dev/null 2>&1; }
# docker_build TAG CONTEXT DOCKERFILE_TEXT [EXTRA_TAG]
docker_build() {
  local tag=$1 ctx=$2 text=$3 extra=${4:-}
  local tags=(-t "$tag")
  [ -z "$extra" ] || tags+=(-t "$extra")
  printf '%s\n' "$text" | "$DOCKER" build --quiet "${tags[@]}" -f - "$ctx"
}
REVISION=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
VERSION=$("$PYTHON" -c 'import sys,tomllib; print(tomllib.load(open(sys.argv[1],"rb"))["project"]["version"])' "$REPO/pyproject.toml")
BASE_IMAGE=pagoda-base:$KEY_BASE
DDEPS_IMAGE=pagoda-daemon-deps:$KEY_DDEPS
ODEPS_IMAGE=pagoda-operator-deps:$KEY_ODEPS
final_dockerfile() {  # FROM_IMAGE TITLE HASH
  cat <<EOF
FROM $1
COPY site-packages/ $SITE/
COPY bin/pagoda /usr/local/bin/pagoda
ENV HOME=/home/pagoda PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 LANG=C.UTF-8
WORKDIR /home/pagoda
USER $UID_GID:$UID_GID
ENTRYPOINT ["pagoda"]
CMD ["--help"]
LABEL org.opencontainers.image.title="$2" \\
      org.opencontainers.image.version="$VERSION" \\
      org.opencontainers.image.revision="$REVISION" \\
      org.opencontainers.image.description="Local Pagoda image built by e2e/image/build-images.sh (no pulls)" \\
      dev.pagoda.content-hash="$3"
EOF
}
built=()
if ! has_image "$BASE_IMAGE"; then
  run_step docker-base "docker image $BASE_IMAGE" docker_build "$BASE_IMAGE" "$BASE_DIR" \
    "$(printf 'FROM scratch\nADD rootfs.tar /\nCMD ["/bin/bash"]')"
  built+=("$BASE_IMAGE")
fi
if ! has_image "$DDEPS_IMAGE"; then
  run_step docker-daemon-deps "docker image $DDEPS_IMAGE (~1.2 GB layer; once per data root)" docker_build "$DDEPS_IMAGE" "$DDEPS_DIR" \
    "$(printf 'FROM %s\nCOPY site-packages/ %s/\n' "$BASE_IMAGE" "$SITE")"
  built+=("$DDEPS_IMAGE")
fi
if ! has_image "$ODEPS_IMAGE"; then
  run_step docker-operator-deps "docker image $ODEPS_IMAGE" docker_build "$ODEPS_IMAGE" "$ODEPS_DIR" \
    "$(printf 'FROM %s\nCOPY site-packages/ %s/\n' "$BASE_IMAGE" "$SITE")"
  built+=("$ODEPS_IMAGE")
fi
if ! has_image "$DAEMON_IMAGE"; then
  run_step docker-daemon "docker image $DAEMON_IMAGE" docker_build "$DAEMON_IMAGE" "$PROJ_DIR" \
    "$(final_dockerfile "$DDEPS_IMAGE" pagoda-daemon "$DAEMON_TAG")" pagoda-daemon:dev
  built+=("$DAEMON_IMAGE")
fi
if ! has_image "$OPERATOR_IMAGE"; then
  run_step docker-operator "docker image $OPERATOR_IMAGE" docker_build "$OPERATOR_IMAGE" "$PROJ_DIR" \
    "$(final_dockerfile "$ODEPS_IMAGE" pagoda-operator "$OPERATOR_TAG")" pagoda-operator:dev
  built+=("$OPERATOR_IMAGE")
fi
# :dev always names the newest build.
"$DOCKER" tag "$DAEMON_IMAGE" pagoda-daemon:dev
"$DOCKER" tag "$OPERATOR_IMAGE" pagoda-operator:dev
# Older tags in this data root: untag them (running containers keep their image's layers).
for repo_keep in "pagoda-daemon $DAEMON_TAG" "pagoda-operator $OPERATOR_TAG" "pagoda-base $KEY_BASE" \
                 "pagoda-daemon-deps $KEY_DDEPS" "pagoda-operator-deps $KEY_ODEPS"; do
  read -r repo keep <<< "$repo_keep"
  "$DOCKER" images --format '{{.Repository}}:{{.Tag}}' "$repo" | grep -vE ":(dev|$keep)$" \
    | xargs -r "$DOCKER" rmi >/dev/null 2>&1 || true
done
if [ "${#built[@]}" = 0 ]; then say "up to date: $DAEMON_IMAGE $OPERATOR_IMAGE"; else say "built ${built[*]}"; fi
echo "DAEMON_IMAGE=$DAEMON_IMAGE"
echo "OPERATOR_IMAGE=$OPERATOR_IMAGE"
