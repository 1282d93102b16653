#!/bin/bash
# Verifier: runs the agent's script on a quick command, a failing one, a slow one and one that
# ignores SIGTERM; checks exit statuses, output, how long the slow ones took, and the log.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
s=/app/run_with_timeout.sh
: > /app/runs.log
check "script is executable" test -x "$s"
out=$(timeout 10 "$s" 5 echo hello world); rc=$?
check "quick command output" test "$out" = "hello world"
check "quick command status 0" test "$rc" = 0
timeout 10 "$s" 5 sh -c 'exit 3'; rc=$?
check "failing command status 3" test "$rc" = 3
start=$(date +%s%N)
timeout 10 "$s" 1 sleep 8 >/dev/null 2>&1; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
check "slow command status 124" test "$rc" = 124
check "slow command stopped in time ($ms ms)" test "$rc" = 124 -a "$ms" -lt 3500
start=$(date +%s%N)
timeout 10 "$s" 1 bash -c 'trap "" TERM; while :; do sleep 0.1; done' >/dev/null 2>&1; rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
check "TERM-ignoring command status 124" test "$rc" = 124
check "TERM-ignoring command killed in time ($ms ms)" test "$rc" = 124 -a "$ms" -lt 4500
cat /app/runs.log
check "log lines" test "$(cat /app/runs.log)" = "0 echo hello world
3 sh -c exit 3
124 sleep 8
124 bash -c trap \"\" TERM; while :; do sleep 0.1; done"
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
