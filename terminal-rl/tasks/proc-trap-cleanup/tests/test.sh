#!/bin/bash
# Verifier: a full run, then a run stopped by SIGTERM and one stopped by SIGHUP (the signal is sent
# to the PID the worker wrote), checking exit status, pid-file removal and the status line.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
rm -f worker.pid worker.status worker.out
timeout 10 /app/worker.sh 3; rc=$?
check "full run exits 0" test "$rc" = 0
check "full run: 3 ticks" test "$(cat worker.out 2>/dev/null)" = $'tick 1\ntick 2\ntick 3'
check "full run: status done" test "$(cat worker.status 2>/dev/null)" = done
check "full run: pid file removed" test "$rc" = 0 -a ! -e worker.pid

stopped_by() {  # stopped_by SIGNAL EXPECTED_STATUS: start a long run, signal it after two ticks
  rm -f worker.pid worker.status
  timeout 20 /app/worker.sh 100 & bg=$!
  for _ in $(seq 50); do
    [ -s worker.pid ] && [ "$(grep -c tick worker.out 2>/dev/null)" -ge 2 ] && break
    kill -0 "$bg" 2>/dev/null || break
    sleep 0.1
  done
  local pid; pid=$(cat worker.pid 2>/dev/null)
  check "$1: worker wrote its pid" test -n "$pid"
  local t0; t0=$(date +%s%N)
  [ -n "$pid" ] && kill "-$1" "$pid"
  wait "$bg"; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  check "$1: exit status $2 (got $rc after $ms ms)" test "$rc" = "$2" -a "$ms" -lt 1500
  check "$1: pid file removed" test -n "$pid" -a ! -e worker.pid
  local k; k=$(grep -c tick worker.out 2>/dev/null)
  check "$1: status reports $k ticks" test "$(cat worker.status 2>/dev/null)" = "interrupted after $k ticks"
}
stopped_by TERM 143
stopped_by HUP 129
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
