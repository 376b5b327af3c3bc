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

# start_clock TAG: name this script in its messages and start the clock `elapsed` reads.
start_clock() {
  LOG_TAG=$1
  T_START=$(date +%s)
}

# elapsed: time since start_clock, as 1m02s.
elapsed() {
  local s=$(( $(date +%s) - T_START ))
  printf '%dm%02ds' $((s / 60)) $((s % 60))
}

# say MSG...: a progress line, tagged and timed.
say() { echo "[$LOG_TAG $(elapsed)] $*"; }

# die MSG [LOG]: an error line (and LOG's last lines, if given), then exit 1.
die() {
  echo "[$LOG_TAG] ERROR: $1" >&2
  if [ -n "${2:-}" ] && [ -f "$2" ]; then echo "[$LOG_TAG] last lines of $2:" >&2; log_tail "$2" 25; fi
  exit 1
}

# run_step NAME DESCRIPTION CMD...: run CMD with its output in $LOGS/NAME.log; on failure say
# which step broke, where its log is, show its last lines and exit with CMD's code.
run_step() {
  local name=$1 desc=$2 log=$LOGS/$1.log t0
  shift 2
  t0=$(date +%s)
  say "$desc (log: $log)"
  run_logged "$log" "$@"
  if [ "$RUN_RC" != 0 ]; then
    echo "[$LOG_TAG] ERROR: step '$name' ($desc) failed with exit code $RUN_RC. Log: $log ; last 30 lines:" >&2
    log_tail "$log" 30
    exit "$RUN_RC"
  fi
  say "  done: $name in $(( $(date +%s) - t0 ))s"
}
