#!/usr/bin/env bash
# `make test`'s two halves at once: the end-to-end suite on the real node (mostly waiting on the kubelet, the
# runtime and Prometheus) beside the rest of the suite (the API servers, the disk, the processes), so the whole
# takes about as long as the longer of the two instead of their sum (measured in docs/development.md).
#
#   VENV=.venv PYTEST_WORKERS=2 PYTEST_ARGS=... E2E_ARGS=... hack/test_all.sh    (as `make test` calls it)
#
# The e2e's output goes to .cache/e2e.log, printed when both are done (the two do not interleave); the exit
# status is the suite's when it failed, else the e2e's. Ctrl-C reaches both pytests (one process group) and
# this script waits for both to tear their servers down; a TERM to this script is passed on to both as SIGINT.
set -uo pipefail
cd "$(dirname "$0")/.." || exit

venv=${VENV:-.venv}
read -r -a suite_args <<<"${PYTEST_ARGS:-}"
read -r -a e2e_args <<<"${E2E_ARGS:-}"
mkdir -p .cache
log=.cache/e2e.log

# A job started with `&` by a shell without job control ignores SIGINT, and Python then never raises
# KeyboardInterrupt: `env --default-signal` gives each pytest its Ctrl-C back, so its fixtures tear down.
env --default-signal=INT "$venv/bin/pytest" -m 'e2e and not nodes' "${e2e_args[@]}" >"$log" 2>&1 &
e2e=$!
env --default-signal=INT "$venv/bin/pytest" -n "${PYTEST_WORKERS:-2}" --dist loadgroup -m 'not e2e' \
	"${suite_args[@]}" &
suite=$!
echo "[test] the end-to-end suite runs beside the rest (pid $e2e); its output: $log, printed when both are done"

trap 'kill -INT "$suite" "$e2e" 2>/dev/null' TERM
trap ':' INT # the terminal's Ctrl-C went to both pytests too: wait for them to finish tearing down

# The exit status of `pid`, however many trapped signals interrupt the wait.
status_of() {
	while kill -0 "$1" 2>/dev/null; do
		wait "$1"
	done
	wait "$1"
}

status_of "$suite"
suite_rc=$?
status_of "$e2e"
e2e_rc=$?
echo "[test] the end-to-end suite ($log), exit status $e2e_rc:"
cat "$log"
echo "[test] the suite's exit status $suite_rc, the end-to-end suite's $e2e_rc"
if [ "$suite_rc" -ne 0 ]; then
	exit "$suite_rc"
fi
exit "$e2e_rc"
