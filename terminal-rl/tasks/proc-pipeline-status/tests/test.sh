#!/bin/bash
# Verifier: failures must be reported (a missing source: grep exits 2 in stage 1; an output in a
# missing directory: the last stage's redirection fails with 1); good input and input without
# orders must still work, which is a condition rather than points (the unfixed script does that).
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; fi
}
t=$(mktemp -d)
printf 'order,zed,500\nrefund,x,900\norder,amy,101\norder,bo,100\n' > "$t/in.txt"
printf 'refund,x,900\n' > "$t/none.txt"

out=$(timeout 10 /app/report.sh "$t/missing.txt" "$t/m.out" 2>"$t/err"); rc=$?
check "missing source: status 2, no success message" test "$rc" = 2 -a -z "$out"
check "missing source: names stage 1" grep -qx 'pipeline failed: stage 1 exited with 2' "$t/err"
# (a source without orders, so that no earlier stage has output to die of SIGPIPE on)
out=$(timeout 10 /app/report.sh "$t/none.txt" "$t/no/such/dir/out.txt" 2>"$t/err"); rc=$?
check "unwritable output: status 1, no success message" test "$rc" = 1 -a -z "$out"
check "unwritable output: names stage 3" grep -qx 'pipeline failed: stage 3 exited with 1' "$t/err"

still_works=yes
out=$(timeout 10 /app/report.sh "$t/in.txt" "$t/out.txt" 2>/dev/null); rc=$?
if [ "$rc" = 0 ] && [ "$out" = "report written to $t/out.txt" ] && [ "$(cat "$t/out.txt")" = $'amy\nzed' ]; then
  echo "PASS good input: same report, status 0, message"
else
  echo "FAIL good input: same report, status 0, message"; still_works=no
fi
out=$(timeout 10 /app/report.sh "$t/none.txt" "$t/none.out" 2>/dev/null); rc=$?
if [ "$rc" = 0 ] && [ -f "$t/none.out" ] && [ ! -s "$t/none.out" ] && [ "$out" = "report written to $t/none.out" ]; then
  echo "PASS no orders: empty report, status 0"
else
  echo "FAIL no orders: empty report, status 0"; still_works=no
fi
awk -v p="$pass" -v t="$total" -v ok="$still_works" 'BEGIN { printf "%.4f\n", p / t * (ok == "yes" ? 1 : 0.5) }' \
  > /logs/verifier/reward.txt
