#!/bin/bash
# Verifier: each rendered file and missing.txt byte-for-byte against the expected output.
cd /app
mkdir -p /logs/verifier
pass=0; total=0
check() {  # check NAME COMMAND...: one point when COMMAND succeeds
  total=$((total + 1))
  if "${@:2}" >/dev/null 2>&1; then pass=$((pass + 1)); echo "PASS $1"; else echo "FAIL $1"; diff "$3" "$4" | head -5; fi
}
for f in nginx.conf app.env plain.txt missing.txt; do
  check "$f" cmp "/tests/expected/$f" "/app/out/$f"
done
awk -v p="$pass" -v t="$total" 'BEGIN { printf "%.4f\n", p / t }' > /logs/verifier/reward.txt
