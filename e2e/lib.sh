# shellcheck shell=bash
# Shell helpers shared by the cluster, image and quickstart scripts (sourced, not run).

# run_logged LOG CMD...: run CMD in a subshell under `set -euo pipefail` with its output in
# LOG, and leave its exit code in RUN_RC. Call it as a plain statement, never in an `if` or
# after `||`: bash ignores `set -e` inside a condition, subshells included, so a failing
# command in CMD would go unnoticed.
run_logged() {
  local log=$1; shift
  set +e
  ( set -euo pipefail; "$@" ) >"$log" 2>&1
  # shellcheck disable=SC2034  # read by the caller
  RUN_RC=$?
  set -e
}

# log_tail LOG N: the last N lines of LOG, indented, on stderr (what a failure message shows).
log_tail() {
  tail -n "$2" "$1" | sed 's/^/    /' >&2
}
