#!/bin/bash
# Verifier: runs parallel.sh once, timing it; then the per-job outputs, statuses and the summary.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
rm -rf /app/results
t0=$(date +%s%N)
summary=$(timeout 15 /app/parallel.sh 2>/dev/null); rc=$?
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
check "summary line" test "$(echo "$summary" | tail -n 1)" = "ok=3 failed=1"
check "exit status 1 (one job failed)" test "$rc" = 1
check "ran in parallel ($ms ms)" test -s /app/results/delta.out -a "$ms" -lt 2800
check "alpha" test "$(cat results/alpha.out 2>/dev/null)/$(cat results/alpha.rc 2>/dev/null)" = "alpha: 3 files/0"
check "beta" test "$(cat results/beta.out 2>/dev/null)/$(cat results/beta.rc 2>/dev/null)" = "beta: checksum ok/0"
check "gamma" test "$(cat results/gamma.out 2>/dev/null)/$(cat results/gamma.rc 2>/dev/null)" = "gamma: failed/5"
check "delta" test "$(cat results/delta.out 2>/dev/null)/$(cat results/delta.rc 2>/dev/null)" = $'delta: line1\ndelta: line2/0'
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
