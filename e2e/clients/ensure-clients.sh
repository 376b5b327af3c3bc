#!/usr/bin/env bash
# ensure-clients.sh: one virtual environment per third-party client the compatibility tests run
# (e2e/test_clients.py), installed from the package registry at the versions pinned in
# e2e/clients/<tool>.txt. Each tool gets its own: their dependency pins disagree.
#
# Cached outside the clone, keyed by the requirements file's content, so a second clone or CI run
# reuses them and a changed pin builds a fresh one:
#
#   ${PAGODA_CACHE:-$HOME/.cache/pagoda}/clients/<tool>-<sha of tool.txt>/   (bin/<tool>)
#
# Usage: ensure-clients.sh [--check] [--print-dir TOOL]
#   --check           install nothing; exit 0 if every environment is present, 1 if not
#   --print-dir TOOL  print TOOL's environment directory and exit
# The four install in parallel: 1m11s on 2 cores with pip's download cache warm (2026-11-24);
# longer where every wheel must be downloaded. Once built: nothing to do.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=../lib.sh
. "$HERE/../lib.sh"
start_clock ensure-clients

TOOLS=(lm-eval guidellm aiperf inference-perf)
CACHE=${PAGODA_CACHE:-$HOME/.cache/pagoda}/clients
PYTHON=${PYTHON:-python3}

# inference-perf publishes only for Python >= 3.12 (with 3.11, pip finds no distribution of it):
# $PYTHON312, else a python3.12 that runs, else pyenv's, else $PYTHON when it is 3.12 or newer.
python312() {
  local c
  for c in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 \
           "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$PYTHON"; do
    [ -n "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { echo "$c"; return 0; }
  done
  return 1
}

python_for() {
  if [ "$1" = inference-perf ]; then python312 || die "inference-perf needs Python 3.12 or newer: set PYTHON312"
  else echo "$PYTHON"; fi
}

env_dir() {
  local sha
  sha=$(sha256sum "$HERE/$1.txt" | cut -c1-12)
  echo "$CACHE/$1-$sha"
}

case "${1:-}" in
  --print-dir) env_dir "$2"; exit 0 ;;
  --check)
    for t in "${TOOLS[@]}"; do [ -f "$(env_dir "$t")/.complete" ] || { echo "missing: $t"; exit 1; }; done
    exit 0 ;;
esac

mkdir -p "$CACHE/logs"
pids=()
for t in "${TOOLS[@]}"; do
  dir=$(env_dir "$t")
  if [ -f "$dir/.complete" ]; then
    say "$t: present in $dir"
    continue
  fi
  py=$(python_for "$t")
  (
    rm -rf "$dir"
    "$py" -m venv "$dir"
    "$dir/bin/pip" install --quiet --disable-pip-version-check -r "$HERE/$t.txt"
    touch "$dir/.complete"
  ) > "$CACHE/logs/$t.log" 2>&1 &
  pids+=("$!:$t")
  say "$t: installing into $dir (log $CACHE/logs/$t.log)"
done
failed=0
for entry in "${pids[@]}"; do
  pid=${entry%%:*} t=${entry#*:}
  if wait "$pid"; then say "$t: installed"; else say "$t: FAILED, see $CACHE/logs/$t.log"; failed=1; fi
done
[ "$failed" = 0 ] || die "a client could not be installed"
say "all clients ready in $CACHE"
