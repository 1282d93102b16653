#!/bin/bash
# Verifier: a command that succeeds on its third try, one that always fails, one that succeeds at once.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
flaky='n=$(cat /tmp/retry-count 2>/dev/null || echo 0); n=$((n + 1)); echo $n > /tmp/retry-count; echo "try $n"; [ $n -ge 3 ] || exit 7'
rm -f /tmp/retry-count
out=$(timeout 10 /app/retry.sh 5 0.1 bash -c "$flaky" 2>/tmp/retry-err); rc=$?
check "flaky: exit 0" test "$rc" = 0
check "flaky: ran three times" test "$(cat /tmp/retry-count 2>/dev/null)" = 3
check "flaky: output passed through" test "$out" = $'try 1\ntry 2\ntry 3'
check "flaky: failures reported" test "$(cat /tmp/retry-err)" = $'attempt 1 failed with status 7\nattempt 2 failed with status 7'
rm -f /tmp/retry-count
t0=$(date +%s%N)
timeout 10 /app/retry.sh 3 0.3 bash -c 'echo x >> /tmp/retry-count; exit 4' >/dev/null 2>/tmp/retry-err; rc=$?
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
check "always failing: last status 4" test "$rc" = 4
check "always failing: three attempts" test "$(wc -l < /tmp/retry-count)" = 3
check "always failing: slept between attempts only ($ms ms)" test "$ms" -ge 550 -a "$ms" -lt 1500
check "always failing: three reports" test "$(grep -c '^attempt [123] failed with status 4$' /tmp/retry-err)" = 3
out=$(timeout 10 /app/retry.sh 3 5 echo fine 2>/tmp/retry-err); rc=$?
check "immediate success" test "$rc" = 0 -a "$out" = fine -a ! -s /tmp/retry-err
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
